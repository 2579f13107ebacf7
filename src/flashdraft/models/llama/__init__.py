"""The Llama-3.x and Qwen3 family: one decoder-only model (model.py) and its GGUF loading (gguf.py)."""
