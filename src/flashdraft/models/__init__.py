from flashdraft.models.decoder_lm import DecoderLM
from flashdraft.models.drafter import DFlashDrafter

__all__ = ["DecoderLM", "DFlashDrafter"]
