"""Time Gemma 4's joins of a branch to the residual (s = h + norm(attn), then norm(s) for the feed-forward; and
(h + norm(ff)) * layer scalar, then its norm for the next layer) as a compiled layer computed them (the same ops
under torch.compile(dynamic=True): Inductor's fused reductions) against the one-kernel joins of
layers.rms_norm_rows (gemma_add_norm, gemma_add_scaled_norm), at Gemma-4-31B's width and 1 / 16 rows, each as 60
calls in a CUDA graph (one a layer of the 31B); check that the kernels' rows match the compiled ones' within bf16
rounding and are the same bits alone as in a block.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/gemma_joins_run.py OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_run import graphed_per_call_ms  # noqa: E402

from flashdraft.layers.rms_norm_rows import gemma_add_norm, gemma_add_scaled_norm  # noqa: E402
from flashdraft.models.gemma4.model import Gemma4RMSNorm  # noqa: E402

WIDTH, LAYERS, EPS = 5376, 60, 1e-6


def main(out: Path) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    norms = [Gemma4RMSNorm(WIDTH, EPS).to(dev, dtype) for _ in range(4)]
    for n in norms:
        n.weight.data = (0.5 + torch.rand(WIDTH, device=dev, generator=gen)).to(dtype)
    scalar = torch.tensor([0.8], device=dev, dtype=dtype)
    post_attn, pre_ff, post_ff, next_input = norms

    @torch.compile(dynamic=True)
    def compiled_after_attention(attn, h):
        h = h + post_attn(attn)
        return h, pre_ff(h)

    @torch.compile(dynamic=True)
    def compiled_after_ffn(ff, h):
        h = (h + post_ff(ff)) * scalar
        return h, next_input(h)

    def kernel_after_attention(attn, h):
        return gemma_add_norm(attn, h, post_attn.weight, pre_ff.weight, EPS)

    def kernel_after_ffn(ff, h):
        return gemma_add_scaled_norm(ff, h, post_ff.weight, scalar, next_input.weight, EPS)

    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "width": WIDTH, "calls_a_graph": LAYERS, "rows": []}
    with torch.no_grad():
        for T in (1, 16):
            xs = [torch.randn(T, WIDTH, device=dev, generator=gen).mul(4).to(dtype) for _ in range(LAYERS)]
            hs = [torch.randn(T, WIDTH, device=dev, generator=gen).mul(20).to(dtype) for _ in range(LAYERS)]
            row = {"T": T}
            for name, compiled, kernel in (("after attention", compiled_after_attention, kernel_after_attention),
                                           ("after feed-forward", compiled_after_ffn, kernel_after_ffn)):
                ref, ours = compiled(xs[0], hs[0]), kernel(xs[0], hs[0])
                ref, ours = (ref if isinstance(ref, tuple) else (ref,)), (ours if isinstance(ours, tuple) else (ours,))
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, ours))
                differ = sum((a != b).sum().item() for a, b in zip(ref, ours)) / sum(a.numel() for a in ref)
                alone = kernel(xs[0][-1:], hs[0][-1:])
                alone = alone if isinstance(alone, tuple) else (alone,)
                same_alone = all(torch.equal(a[0], b[-1]) for a, b in zip(alone, ours))
                us = {label: 1000 * graphed_per_call_ms([lambda i=i, f=f: f(xs[i], hs[i]) for i in range(LAYERS)])
                      for label, f in (("compiled", compiled), ("kernel", kernel))}
                row[name] = {"us_compiled": us["compiled"], "us_kernel": us["kernel"], "max_abs_diff": err,
                             "share_of_values_differing": differ, "last_row_same_bits_alone": same_alone}
                print(f"T={T:2d} {name:>18s}: compiled {us['compiled']:6.2f} us, kernel {us['kernel']:6.2f} us; "
                      f"max |diff| {err:.3g}, {100 * differ:.2f}% of values differ; row alone same bits: "
                      f"{same_alone}", flush=True)
            results["rows"].append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemma_joins.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    main(ap.parse_args().out)
