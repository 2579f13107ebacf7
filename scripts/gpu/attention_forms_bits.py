"""Which decode-attention tilings of the same key steps and ranges give one token the same bits: 16- and 32-row
tiles (the warp's tensor-core product, mma.sync) on 2 or 4 warps, 64-row tiles (the warpgroup's, wgmma) on 4 or 8,
every pair compared over a few seeds (bf16, Qwen3-8B's attention shape, a 32912-row cache, kv_len 8192). Bits
shared across the two product forms would let a one-token step take a 16-row tile where a verify block takes the
64-row one; docs/performance.md has the answer ("The whole-block tile's 16-row twin").

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/attention_forms_bits.py
"""
import torch

from flashdraft.layers.decode_attention import AttentionConfig, launch

TILINGS = {"q64w4": AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True),
           "q64w8": AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=8, num_stages=2, pipelined=True),
           "q16w4": AttentionConfig(block_n=64, split=1024, num_warps=4, num_stages=3, pipelined=True),
           "q16w2": AttentionConfig(block_n=64, split=1024, num_warps=2, num_stages=3, pipelined=True),
           "q32w4": AttentionConfig(block_q=32, block_n=64, split=1024, num_warps=4, num_stages=3, pipelined=True)}


def main(capacity: int = 32912, kv_len: int = 8192, seeds: int = 3) -> None:
    dev = torch.device("cuda")
    same = {}
    for seed in range(seeds):
        g = torch.Generator(device=dev).manual_seed(seed)
        k = torch.randn(8, capacity, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(8, capacity, 128, device=dev, dtype=torch.bfloat16, generator=g)
        q = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16, generator=g).transpose(0, 1)
        mask = torch.ones(1, kv_len, dtype=torch.bool, device=dev)
        out = {name: launch(q, k[:, :kv_len], v[:, :kv_len], mask, c) for name, c in TILINGS.items()}
        for a in TILINGS:
            for b in TILINGS:
                if a < b:
                    same[a, b] = same.get((a, b), 0) + torch.equal(out[a], out[b])
    for (a, b), n in sorted(same.items()):
        print(f"{a} vs {b}: {n}/{seeds} bitwise equal")


if __name__ == "__main__":
    main()
