"""Decoding engine: static KV cache, sampling, the DFlash loop, generation with stop rules and statistics."""
