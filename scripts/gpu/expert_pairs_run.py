"""MoE experts multiplied pair by pair from their blocks on the GPU (QuantGemma4Experts' pair products, issue #18:
Gemma-4-26B-A4B's experts in their blocks): at the 26B-A4B's shapes (128 experts; gate|up 1408 x 2816 in Q4_K,
down 2816 x 704 in Q8_0, as a Q4_K_M file has K not a multiple of 256 in a legacy type), a one-token and a 16-token
pass of the experts' module, against the dequantized path it replaces:
- bits: each token of the 16-token pass equals the token alone (batch invariance; eager and through torch.compile),
  and each pair's row, of both projections, equals the one-weight kernel's (gguf_triton.launch) with its expert's
  blocks;
- agreement with the dequantized path (relative error of the bf16 outputs);
- time per call inside a CUDA graph, and the bytes the chosen experts' blocks hold;
- with --sweep, each projection's pair product alone (8 and 128 pairs) over a few tilings beside config_for's (a
  tiling is chosen per weight shape, never per pair count: batch invariance), as the one-token pass's 176 programs
  of 64 gate|up rows each leave most of an H100's 132 SMs with one program.

    PYTHONPATH=src python scripts/gpu/expert_pairs_run.py OUT [--sweep]    (OUT/expert_pairs.json)
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_run import graphed_per_call_ms  # noqa: E402
from gguf_run import random_blocks  # noqa: E402

from flashdraft.kernels import gguf_triton  # noqa: E402
from flashdraft.models.gemma4.gguf import QuantGemma4Experts  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2816, 704
GATE_UP, DOWN = "Q4_K", "Q8_0"


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.stack([random_blocks(GATE_UP, 2 * INTERMEDIATE, HIDDEN, gen, dev) for _ in range(EXPERTS)])
    down = torch.stack([random_blocks(DOWN, HIDDEN, INTERMEDIATE, gen, dev) for _ in range(EXPERTS)])
    pairs = QuantGemma4Experts((gate_up, GATE_UP), (down, DOWN), HIDDEN, INTERMEDIATE, torch.bfloat16,
                               pair_products=True)
    dequantized = QuantGemma4Experts((gate_up, GATE_UP), (down, DOWN), HIDDEN, INTERMEDIATE, torch.bfloat16)
    x = torch.randn(16, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(EXPERTS, device=dev, generator=gen)[:TOP_K] for _ in range(16)])
    weights = torch.rand(16, TOP_K, device=dev, generator=gen)
    block = pairs(x, weights, experts)
    alone = [torch.equal(pairs(x[t:t + 1], weights[t:t + 1], experts[t:t + 1]), block[t:t + 1]) for t in range(16)]
    # each pair row (distinct rows of x, both projections' kernels) against the one-weight kernel with its expert
    gu = gguf_triton.launch_experts(x[:TOP_K], gate_up, experts[0], GATE_UP)
    mid = torch.randn(TOP_K, INTERMEDIATE, device=dev, generator=gen).to(torch.bfloat16)
    dn = gguf_triton.launch_experts(mid, down, experts[0], DOWN)
    one_weight = all(
        torch.equal(gu[c:c + 1], gguf_triton.launch(x[c:c + 1], gate_up[experts[0, c]], 2 * INTERMEDIATE, GATE_UP))
        and torch.equal(dn[c:c + 1], gguf_triton.launch(mid[c:c + 1], down[experts[0, c]], HIDDEN, DOWN))
        for c in range(TOP_K))
    # and through torch.compile: a token alone against the same token in the block (all 16 tokens)
    compiled = torch.compile(pairs, fullgraph=True, dynamic=True)  # as the engine compiles a layer
    block_c = compiled(x, weights, experts)
    alone_compiled = [torch.equal(compiled(x[t:t + 1], weights[t:t + 1], experts[t:t + 1]), block_c[t:t + 1])
                      for t in range(16)]
    ref = dequantized(x, weights, experts)
    rel = ((block.float() - ref.float()).norm() / ref.float().norm()).item()
    chosen_bytes = TOP_K * (2 * INTERMEDIATE * row_bytes(GATE_UP, HIDDEN) + HIDDEN * row_bytes(DOWN, INTERMEDIATE))
    result = {"device": torch.cuda.get_device_name(), "tokens_alone_equal_in_block": alone,
              "compiled_alone_equal_in_block": alone_compiled,
              "pair_rows_equal_one_weight_kernel": one_weight, "rel_err_vs_dequantized": rel,
              "chosen_bytes_per_token": chosen_bytes, "us": {}}
    for name, module in (("pairs", pairs), ("dequantized", dequantized)):
        for t in (1, 16):
            us = 1000 * graphed_per_call_ms([lambda m=module, t=t: m(x[:t], weights[:t], experts[:t])], est_ms=0.5)
            result["us"][f"{name} T={t}"] = us
            print(f"{name:12s} T={t:2d}: {us:8.1f} us a call ({chosen_bytes * t / us / 1e6:.2f} TB/s of chosen "
                  f"experts' blocks)", flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "us"}), flush=True)
    (out / "expert_pairs.json").write_text(json.dumps(result, indent=1))
    if "--sweep" in sys.argv:
        result["sweep"] = sweep(x, gate_up, down, experts)
        (out / "expert_pairs.json").write_text(json.dumps(result, indent=1))
    return 0 if all(alone) and all(alone_compiled) and one_weight and rel < 2e-2 else 1


def sweep(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor) -> dict:
    """us a call of each projection's pair product at 8 and 128 pairs, for config_for's tiling and neighbours."""
    found = {}
    mid = torch.randn(128, INTERMEDIATE, device=x.device).to(x.dtype)
    ids = experts.reshape(-1)
    for name, blocks, qtype, rows in (("gate|up", gate_up, GATE_UP, x[:, None].expand(16, TOP_K, HIDDEN)
                                       .reshape(-1, HIDDEN)), ("down", down, DOWN, mid)):
        n, k, sms = blocks.shape[1], rows.shape[1], gguf_triton.sm_count(x.device.index)
        base = gguf_triton.config_for(qtype, n, k, sms)
        configs = [base, replace(base, block_n=32), replace(base, block_n=16), replace(base, num_warps=2),
                   replace(base, block_n=32, num_warps=2)]
        if not base.packed:  # legacy types: a shorter K step, which lets K split
            configs += [replace(base, block_k=32, split_k=gguf_triton.split_for(n, k, 32, 32, sms)),
                        replace(base, block_n=32, block_k=32, split_k=gguf_triton.split_for(n, k, 32, 32, sms))]
        for c in dict.fromkeys(configs):  # each tiling once
            for pairs in (8, 128):
                r, e = rows[:pairs].contiguous(), ids[:pairs].contiguous()
                us = 1000 * graphed_per_call_ms([lambda r=r, e=e, c=c: gguf_triton.launch_experts(r, blocks, e,
                                                                                                  qtype, c)],
                                                est_ms=0.05)
                found[f"{name} {c.name} P={pairs}"] = us
                print(f"sweep {name:8s} {c.name:16s} P={pairs:3d}: {us:7.1f} us"
                      + ("  (config_for)" if c == base else ""), flush=True)
    return found


if __name__ == "__main__":
    sys.exit(main())
