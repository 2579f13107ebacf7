"""The Llama-3.x and Qwen3 family: one decoder-only model and the DFlash drafter built of its layers (model.py),
loaded from Hugging Face folders (loader.py) and GGUF files (gguf.py)."""
