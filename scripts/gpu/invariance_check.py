"""Which layers of a GGUF model break batch invariance on the GPU: lossless greedy DFlash needs a token's logits to
be the same bits verified inside a block as decoded alone. For every Linear / QuantLinear of the loaded target (the
fused projections held outside the module tree included), the product of 16 random rows against the products of
their first 1, 2, 3, 8 rows; then the target as the engine built it (plan, prepared weights, compiled layers where
it compiles them), a 16-token block against the same tokens one at a time.

    python scripts/gpu/invariance_check.py FILE.gguf     # prints every mismatch; exit status 1 if any
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from flashdraft.engine.generator import Engine
from flashdraft.quant.linear import QuantLinear


def linear_layers(model: nn.Module):
    """(name, layer) for every Linear-like layer, the fused ones kept in a module's __dict__ too."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)) or hasattr(module, "in_features"):
            yield name, module
        for key, value in vars(module).items():
            if isinstance(value, nn.Module) and key not in module._modules:
                yield f"{name}.{key} (fused)", value


def block_check(target, n: int, label: str) -> list[int]:
    """The target's logits of n tokens in one pass against each token alone (after a 37-token prefill)."""
    vocab, start = target.config.vocab_size, 37
    ids = torch.randint(0, vocab, (start + n,), generator=torch.Generator().manual_seed(2)).cuda()
    cache = target.new_cache(start + 64)
    kv = start + 32
    target(ids[:start], torch.arange(start, device="cuda"), cache, start)
    block = target(ids[start:], torch.arange(start, start + n, device="cuda"), cache, kv)[0]
    alone = [target(ids[start + i:start + i + 1], torch.tensor([start + i], device="cuda"), cache, kv)[0]
             for i in range(n)]
    rows_bad = [i for i, row in enumerate(alone) if not torch.equal(block[i], row[0])]
    print(f"target, {label}: {len(rows_bad)} of {n} block rows differ from the token alone: {rows_bad}", flush=True)
    return rows_bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    engine = Engine.load(args.file, device=torch.device("cuda"), context_size=1024)
    target = engine.decoder.target
    bad = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for name, layer in linear_layers(target):
            k = layer.in_features
            x = torch.randn(args.block, k, device="cuda", dtype=torch.bfloat16, generator=g)
            full = layer(x)
            for rows in (1, 2, 3, 8):
                part = layer(x[:rows])
                if not torch.equal(part, full[:rows]):
                    bad += 1
                    print(f"MISMATCH {name}: {type(layer).__name__} {getattr(layer, 'qtype', 'float')} "
                          f"[{layer.out_features} x {k}], {rows} rows vs {args.block}: max diff "
                          f"{(part.float() - full[:rows].float()).abs().max().item():.3g}", flush=True)
                    break
        print(f"layers checked; {bad} mismatching", flush=True)
        rows_bad = block_check(target, args.block, "as the engine built it")
    return 1 if bad or rows_bad else 0


if __name__ == "__main__":
    sys.exit(main())
