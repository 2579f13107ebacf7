from flashdraft.models.llama.model import DecoderLM, DFlashDrafter
from flashdraft.models.registry import LoadedModel, drafter_block_size, load_drafter, load_model, load_target

__all__ = ["DFlashDrafter", "DecoderLM", "LoadedModel", "drafter_block_size", "load_drafter", "load_model",
           "load_target"]
