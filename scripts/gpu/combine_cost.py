"""How long the decode attention's last program of a (kv head, query tile) takes to add its key ranges' partials
(the kernel's `_combine`), alone in a launch, against the whole attention call, over 32K keys' 32 key ranges:
the tail every call ends with, one program a pair adding the ranges one after another (issue #20's 32K step,
docs/performance.md). The partials lie in L2, as the kernel's programs leave them for the last one.

    PYTHONPATH=src python scripts/gpu/combine_cost.py [OUT_DIR]

Prints, for Qwen3-8B's and Gemma-4-31B's full-layer shapes with their adopted tilings for a 32960-row cache, at
T = 1 and 16: us per call of the combine alone and of the whole call (CUDA graphs), with the one-pass combine
(tiling name "-chain") and, where the tile's rows allow it, the few-row one; OUT_DIR/combine_cost.json.
"""
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_run import graphed_per_call_ms  # noqa: E402

from flashdraft.kernels.attention_triton import _combine  # noqa: E402
from flashdraft.layers.decode_attention import config_for, launch  # noqa: E402

CAPACITY, KV_LEN = 32960, 32768
SHAPES = {"qwen3-8b": (32, 8, 128), "gemma-4-31b full layers": (32, 4, 512)}  # heads, kv heads, head_dim


@triton.jit
def combine_only(m_ptr, l_ptr, acc_ptr, out_ptr, T, N_SPLITS, stride_ot, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_Q: tl.constexpr, FEW_ROWS: tl.constexpr):
    kv = tl.program_id(0)
    tile = tl.program_id(1)
    _combine(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, kv * tl.num_programs(1) + tile, T, N_SPLITS, stride_ot,
             GROUP, D, BLOCK_Q, FEW_ROWS)


def main(out: Path | None) -> None:
    dev = torch.device("cuda")
    rows = []
    for name, (heads, kv_heads, hd) in SHAPES.items():
        c = config_for(hd, CAPACITY, 2)
        group = heads // kv_heads
        cache_k = torch.randn(kv_heads, CAPACITY, hd, device=dev, dtype=torch.bfloat16)
        cache_v = torch.randn_like(cache_k)
        k, v = cache_k[:, :KV_LEN], cache_v[:, :KV_LEN]
        for T in (1, 16):
            tiles = -(-(T * group) // c.block_q)
            splits = -(-KV_LEN // c.split)
            n = kv_heads * tiles * splits * c.block_q
            m = torch.randn(n, device=dev)
            l_sum = torch.rand(n, device=dev) + 1
            acc = torch.randn(n, hd, device=dev)
            o = torch.empty(T, heads * hd, device=dev, dtype=torch.bfloat16)
            q = torch.randn(heads, T, hd, device=dev, dtype=torch.bfloat16)

            for chain in (True, False):  # the combine of one pass, and the few-row one where the tile allows
                few = 0 if chain else c.few_rows(hd, group)
                if not chain and (few == 0 or T * group > few):
                    continue

                def combine():
                    combine_only[(kv_heads, tiles)](m, l_sum, acc, o, T, splits, o.stride(0), GROUP=group, D=hd,
                                                    BLOCK_Q=c.block_q, FEW_ROWS=few, num_warps=c.num_warps)

                tiling = replace(c, few_row_combine=not chain)

                def whole():
                    launch(q, k, v, None, tiling)

                combine_us = graphed_per_call_ms([combine], est_ms=0.01) * 1e3
                whole_us = graphed_per_call_ms([whole], est_ms=0.1) * 1e3
                row = {"shape": name, "T": T, "tiling": tiling.name, "splits": splits, "pairs": kv_heads * tiles,
                       "combine_us": round(combine_us, 2), "whole_us": round(whole_us, 2)}
                rows.append(row)
                print(f"{name:24s} T={T:2d} {splits} ranges, {kv_heads * tiles} pairs: combine alone "
                      f"{combine_us:7.2f} us, whole call {whole_us:7.2f} us  ({tiling.name})", flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "combine_cost.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                          indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
