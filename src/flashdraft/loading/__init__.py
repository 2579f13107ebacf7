"""File formats: HF folders (config.json + safetensors), GGUF files, tokenizers with their chat templates.
What the tensors become is flashdraft.models' (models.registry picks the loader)."""
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.loading.gguf import GGUFFile, GGUFTokenizer
from flashdraft.loading.tokenizer import Tokenizer

__all__ = ["CheckpointError", "GGUFFile", "GGUFTokenizer", "Tokenizer"]
