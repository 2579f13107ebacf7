"""The L2 prefetch of o_proj (layers.l2_prefetch) measured alone, at Qwen3-8B's shapes on one GPU: per "layer",
decode attention (32 query heads over 8 key/value heads of 128, KV_LEN cached rows) then the o_proj GEMM with its
residual (4096 x 4096 bf16, M = 1), with and without the weight streaming into L2 on a side stream during the
attention; also each piece alone, and the prefetch kernel's tilings. Every figure is the time per call in a CUDA
graph whose calls rotate over enough weight copies to defeat the L2.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/l2_prefetch_run.py OUT_DIR
Writes OUT_DIR/l2_prefetch.json and prints one line per measurement.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_run import L2_BYTES, graphed_per_call_ms  # noqa: E402

from flashdraft.layers import l2_prefetch  # noqa: E402
from flashdraft.layers import skinny_gemm as sg  # noqa: E402
from flashdraft.layers.decode_attention import decode_attention  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, KV_LEN = 4096, 32, 8, 128, 300
# (programs per SM, int32 words per load, warps)
TILINGS = [(2, 2048, 4), (1, 2048, 4), (4, 1024, 4), (4, 2048, 4), (2, 4096, 8), (8, 512, 4)]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copies = max(3, -(-3 * L2_BYTES // (HIDDEN * HIDDEN * 2)))
    weights = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    q = torch.randn(HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    caches = [(torch.randn(KV_HEADS, KV_LEN, HEAD_DIM, device=dev, dtype=torch.bfloat16),
               torch.randn(KV_HEADS, KV_LEN, HEAD_DIM, device=dev, dtype=torch.bfloat16)) for _ in range(copies)]
    side = torch.cuda.Stream(dev)
    results = {"device": torch.cuda.get_device_name(dev), "l2_bytes": torch.cuda.get_device_properties(dev).L2_cache_size,
               "weight_mb": HIDDEN * HIDDEN * 2 / 1e6, "kv_len": KV_LEN, "copies": copies}

    def gemm(i):
        return sg.skinny_linear(x, weights[i], None, residual=residual)

    def attention(i):
        return decode_attention(q, *caches[i], None)

    def prefetch(i, sink, block, warps):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch.launch(weights[i], sink, block, warps)

    def join():
        torch.cuda.current_stream().wait_stream(side)

    def measure(name, call):
        ms = graphed_per_call_ms([lambda i=i: call(i) for i in range(copies)], est_ms=0.02)
        results[name] = ms * 1e3
        print(f"{name:48s} {ms * 1e3:7.2f} us", flush=True)
        return ms

    measure("o_proj GEMM alone (from HBM)", gemm)
    measure("attention alone", attention)
    measure("attention then o_proj", lambda i: (attention(i), gemm(i)))
    for per_sm, block, warps in TILINGS:
        sink = torch.zeros(per_sm * sms, dtype=torch.int32, device=dev)
        tag = f"{per_sm}/SM block {block} w{warps}"
        ms = measure(f"prefetch alone [{tag}]", lambda i: (prefetch(i, sink, block, warps), join()))
        print(f"{'':48s} = {HIDDEN * HIDDEN * 2 / ms / 1e9:7.0f} GB/s", flush=True)
        measure(f"attention || prefetch, then o_proj [{tag}]",
                lambda i: (prefetch(i, sink, block, warps), attention(i), join(), gemm(i)))
        measure(f"prefetch, then o_proj (serial) [{tag}]",
                lambda i: (prefetch(i, sink, block, warps), join(), gemm(i)))
    (out / "l2_prefetch.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
