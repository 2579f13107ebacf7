from flashdraft.models.decoder_lm import DecoderLM
from flashdraft.models.drafter import DFlashDrafter
from flashdraft.models.registry import LoadedModel, load_drafter, load_model, load_target

__all__ = ["DFlashDrafter", "DecoderLM", "LoadedModel", "load_drafter", "load_model", "load_target"]
