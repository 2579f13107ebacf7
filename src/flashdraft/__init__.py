"""flashdraft: local LLM inference with lossless DFlash speculative decoding."""
from flashdraft.config import DrafterConfig, ModelConfig, SamplingParams

__version__ = "0.1.0"
__all__ = ["DrafterConfig", "ModelConfig", "SamplingParams", "__version__"]
