"""Which decode-attention tilings of the same key steps and ranges give one token the same bits: 16- and 32-row
tiles (the warp's tensor-core product, mma.sync) on 2, 4 or 8 warps, 64-row tiles (the warpgroup's, wgmma) on 4 or
8, every pair compared over a few seeds (bf16, a 32912-row cache, kv_len 8192). Bits shared by two tilings let a
pass of few rows take one and a verify block the other (docs/performance.md, "The whole-block tile's 16-row twin":
shared within a product form, not across).

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/attention_forms_bits.py [--shape qwen|gemma-full]
qwen: Qwen3-8B's attention (32 heads over 8 kv heads of 128), 64-key steps in 1024-key ranges; gemma-full:
Gemma-4-31B's full layers (32 heads over 4 kv heads of 512), 32-key steps in 1024-key ranges.
"""
import argparse

import torch

from flashdraft.layers.decode_attention import AttentionConfig, launch

SHAPES = {  # heads, kv_heads, head_dim, tilings
    "qwen": (32, 8, 128, {
        "q64w4": AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True),
        "q64w8": AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=8, num_stages=2, pipelined=True),
        "q16w4": AttentionConfig(block_n=64, split=1024, num_warps=4, num_stages=3, pipelined=True),
        "q16w2": AttentionConfig(block_n=64, split=1024, num_warps=2, num_stages=3, pipelined=True),
        "q32w4": AttentionConfig(block_q=32, block_n=64, split=1024, num_warps=4, num_stages=3, pipelined=True)}),
    "gemma-full": (32, 4, 512, {
        "q16w4": AttentionConfig(block_n=32, split=1024, num_warps=4, num_stages=3, pipelined=True),
        "q16w8": AttentionConfig(block_n=32, split=1024, num_warps=8, pipelined=True),
        "q32w8": AttentionConfig(block_q=32, block_n=32, split=1024, num_warps=8, pipelined=True)}),
}


def main(shape: str, capacity: int = 32912, kv_len: int = 8192, seeds: int = 3) -> None:
    heads, kv_heads, hd, tilings = SHAPES[shape]
    dev = torch.device("cuda")
    same = {}
    for seed in range(seeds):
        g = torch.Generator(device=dev).manual_seed(seed)
        k = torch.randn(kv_heads, capacity, hd, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(kv_heads, capacity, hd, device=dev, dtype=torch.bfloat16, generator=g)
        q = torch.randn(1, heads, hd, device=dev, dtype=torch.bfloat16, generator=g).transpose(0, 1)
        mask = torch.ones(1, kv_len, dtype=torch.bool, device=dev)
        out = {name: launch(q, k[:, :kv_len], v[:, :kv_len], mask, c) for name, c in tilings.items()}
        for a in tilings:
            for b in tilings:
                if a < b:
                    same[a, b] = same.get((a, b), 0) + torch.equal(out[a], out[b])
    for (a, b), n in sorted(same.items()):
        print(f"{shape} {a} ({tilings[a].name}) vs {b} ({tilings[b].name}): {n}/{seeds} bitwise equal")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen")
    main(ap.parse_args().shape)
