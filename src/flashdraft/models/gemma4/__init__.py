"""Gemma 4: its configs (config.py), the target (model.py), its DFlash drafters (drafter.py) and GGUF loading
(gguf.py)."""
