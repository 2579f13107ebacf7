"""The split-KV decode attention (flashdraft.layers.decode_attention) on the GPU at the Qwen3-8B / Llama-3.1-8B
attention shape (32 query heads, 8 kv heads, head_dim 128; or Gemma 4's full layers), against SDPA as the model
calls it:
- error against a float64 reference, beside SDPA's own bf16 error;
- bitwise batch invariance: each token of a 16-token call against the same token alone (other tile places),
  and alone over a longer kv_len (more masked key ranges: a verify step may fall in the next graph bucket); for
  tiles of more than 16 rows, also against the token alone through the same tiling's 16-row tiles; for tilings
  with tensor-descriptor (TMA) loads, against the same tiling's loads by address;
- time per call inside a CUDA graph, rotating over the layers' caches (as a pass meets them, not from L2);
for each of a few tilings (AttentionConfig); OUT_DIR/attention.json names the fastest invariant one ("adopted"),
which perf_run.py --attention-config=OUT_DIR/attention.json then uses.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/attention_run.py OUT_DIR [--long]
    [--shape qwen|gemma-full|gemma-sliding] [--cache-types K,V] [--kv-lens N,N,...]
--long: long contexts instead (8K and 32K keys, and 512 as a short context in a long cache) and tilings with
longer key ranges per program, the fastest at 32K named. --shape gemma-full: Gemma-4-31B's full layers (32 heads
over 4 kv heads of 512); gemma-sliding: its sliding layers (32 heads over 16 kv heads of 256; short caches only,
512 and 1088 keys, the ring's most). --cache-types K,V: caches of those KV cache types (e.g. q5_0,q4_1, the
walkthrough's -ctk / -ctv; default bf16,bf16), read packed by the kernel; the references and SDPA take their
dequantized values, and tilings that load by tensor descriptors (float caches only) are left out. --kv-lens: these
key counts instead of the shape's (e.g. 32,64,128,256,512,1088: a short-context call's time against its keys,
whose intercept is what a call costs before its keys: launch, query loads, partials and their combine).
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_run import graphed_per_call_ms  # noqa: E402
from side_by_side_gguf import kv_types  # noqa: E402

from flashdraft.layers.attention import grouped_attention  # noqa: E402
from flashdraft.layers.decode_attention import CONFIG, AttentionConfig, launch  # noqa: E402
from flashdraft.quant import kv_formats as kf  # noqa: E402


def sdpa(q, k, v, mask):
    out = grouped_attention(q[None], k[None], v[None], mask)
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def graph_us(fn, calls: int) -> float:
    """Microseconds per call of fn(i) for i in 0..calls-1 inside a CUDA graph (gemm_run's timing)."""
    return 1000 * graphed_per_call_ms([lambda i=i: fn(i) for i in range(calls)])


CONFIGS = [CONFIG, AttentionConfig(), AttentionConfig(split=64),
           AttentionConfig(split=256), AttentionConfig(block_n=128, split=256, num_warps=8),
           AttentionConfig(block_n=128, split=128), AttentionConfig(block_n=128, split=128, num_warps=8, num_stages=1),
           AttentionConfig(block_n=64, split=512),
           # a kv head's whole 16-token verify block (64 rows) in one query tile: its keys read once (issue #20)
           AttentionConfig(block_q=64, block_n=128, split=128, num_warps=8), AttentionConfig(block_q=64, split=256),
           # the adopted short-cache tiling with its keys and values by tensor descriptors (TMA)
           dataclasses.replace(CONFIG, tma=True)]
# the tiling adopted for 6145-24576 rows; the whole-block tile adopted beyond, 16-row tilings of its key steps and
# ranges (twins whose bits a one-token step could take, were they the same: they are not, docs/performance.md), and
# the whole-block tile on 8 warps
LONG_CONFIGS = [AttentionConfig(block_n=64, split=512, num_warps=4, num_stages=3, pipelined=True),
                AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True),
                AttentionConfig(block_n=64, split=1024, num_warps=4, num_stages=3, pipelined=True),
                AttentionConfig(block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True),
                AttentionConfig(block_n=64, split=1024, num_warps=2, num_stages=3, pipelined=True),
                AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=8, num_stages=2, pipelined=True),
                # the two adopted long-cache tilings with keys and values by tensor descriptors (TMA)
                AttentionConfig(block_n=64, split=512, num_warps=4, num_stages=3, pipelined=True, tma=True),
                AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True,
                                tma=True),
                # 32-row tiles (the warp's mma.sync, as a one-token step's 16-row tiles): a one-token step pays for
                # 32 rows instead of 64, a 16-token block's 64 rows a kv head read the keys twice instead of once
                AttentionConfig(block_q=32, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True),
                AttentionConfig(block_q=32, block_n=64, split=1024, num_warps=4, num_stages=2, pipelined=True,
                                tma=True),
                AttentionConfig(block_q=32, block_n=64, split=512, num_warps=4, num_stages=3, pipelined=True,
                                tma=True)]
# Gemma 4's full layers (32 query heads over 4 kv heads of 512, ten of them in the 31B): 32-key steps; the adopted
# long tiling, and unrolled
GEMMA_FULL_LONG_CONFIGS = [AttentionConfig(block_n=32, split=1024, num_warps=4, num_stages=3, pipelined=True),
                           AttentionConfig(block_n=32, split=1024, num_warps=4, num_stages=3),
                           # 32-row tiles on 8 warps (243-250 registers, no spill; 64-row ones spill at 512 wide):
                           # a 16-token block's 128 rows a kv head in four programs, not eight
                           AttentionConfig(block_q=32, block_n=32, split=1024, num_warps=8, pipelined=True),
                           AttentionConfig(block_q=32, block_n=16, split=1024, num_warps=8, num_stages=3,
                                           pipelined=True)]
# Gemma 4's short caches (the sliding layers' ring of 1088 rows at most, the full layers' first few thousand
# rows): the tilings of 128-key ranges (WIDEST_HEAD_CONFIG, and WIDE_HEAD_CONFIG until 2026-12-06) against
# shorter key ranges, more programs a layer for a one-token step (16 kv heads of 256, or 4 of 512, in 128-key
# ranges: few programs on 132 multiprocessors); the sliding layers' adopted one is split=64 on 8 warps
GEMMA_SLIDING_CONFIGS = [AttentionConfig(), AttentionConfig(split=64), AttentionConfig(block_n=32, split=64),
                         AttentionConfig(block_n=32, split=32), AttentionConfig(split=64, num_warps=8),
                         AttentionConfig(block_n=32, split=128), AttentionConfig(block_n=32, split=64, num_warps=2)]
GEMMA_FULL_CONFIGS = [AttentionConfig(block_n=32, num_warps=8), AttentionConfig(block_n=32, split=64, num_warps=8),
                      AttentionConfig(block_n=32, split=32, num_warps=8), AttentionConfig(block_n=16, split=64),
                      AttentionConfig(block_n=32, split=64), AttentionConfig(block_n=16, split=32),
                      # the adopted key steps and ranges with the loop pipelined, not unrolled: 148 registers and no
                      # stack where the unrolled loop takes 255 and 304 bytes (sm_90, offline); and 256-key ranges
                      AttentionConfig(block_n=32, num_warps=8, pipelined=True),
                      AttentionConfig(block_n=32, split=256, num_warps=8, pipelined=True)]
# heads, kv_heads, head_dim, layers
SHAPES = {"qwen": (32, 8, 128, 36), "gemma-full": (32, 4, 512, 10), "gemma-sliding": (32, 16, 256, 50)}


def key_counts(spec: str) -> tuple[int, ...]:
    """--kv-lens: comma-separated key counts of at least 22 (the calls start 16 + 5 keys before the end)."""
    try:
        lens = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not N,N,... (key counts)") from None
    if not lens or min(lens) < 22:
        raise argparse.ArgumentTypeError(f"{spec!r}: every key count must be at least 22")
    return lens


def main(out: Path, long: bool = False, shape: str = "qwen", types: tuple[str, str] = ("bf16", "bf16"),
         lens: tuple[int, ...] | None = None) -> None:
    heads, kv_heads, hd, layers = SHAPES[shape]
    k_fmt, v_fmt = kf.kv_format(types[0]), kf.kv_format(types[1])
    if shape == "gemma-sliding" and long:
        raise SystemExit("attention_run.py: --shape gemma-sliding has no long caches (its ring is 1088 rows)")
    short = {"qwen": CONFIGS, "gemma-full": GEMMA_FULL_CONFIGS, "gemma-sliding": GEMMA_SLIDING_CONFIGS}[shape]
    configs = (GEMMA_FULL_LONG_CONFIGS if shape == "gemma-full" else LONG_CONFIGS) if long else short
    if (k_fmt.name, v_fmt.name) != ("bf16", "bf16"):  # tensor descriptors: the compute dtype's rows only
        configs = [c for c in configs if not c.tma]
    kv_lens = lens or ((512, 8192, 32768) if long else (512, 1088) if shape == "gemma-sliding" else (512, 2048, 8192))
    adopt_on = {(32768, 1), (32768, 16)} if long else {(kv, t) for kv in kv_lens[:2] for t in (1, 16)}
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": hd, "layers": layers},
               "cache_types": f"{k_fmt.name},{v_fmt.name}", "rows": []}
    score = {c: 0.0 for c in configs}
    invariant = {c: True for c in configs}
    for kv_len in kv_lens:  # long: 512 as a short chat in a long cache
        cap = kv_len + 256
        # each layer's cache as stored (packed for block types), and its values as attention sees them
        ks = [kf.quantize(torch.randn(kv_heads, cap, hd, device=dev, dtype=torch.bfloat16, generator=gen), k_fmt)
              for _ in range(layers)]
        vs = [kf.quantize(torch.randn(kv_heads, cap, hd, device=dev, dtype=torch.bfloat16, generator=gen), v_fmt)
              for _ in range(layers)]
        kds = [kf.read_rows(k, hd, torch.bfloat16) for k in ks]
        vds = [kf.read_rows(v, hd, torch.bfloat16) for v in vs]
        row_bytes = ks[0].shape[-1] * ks[0].element_size() + vs[0].shape[-1] * vs[0].element_size()
        start = kv_len - 16 - 5
        for T in (1, 16):
            q = torch.randn(T, heads, hd, device=dev, dtype=torch.bfloat16, generator=gen).transpose(0, 1)
            pos = torch.arange(start, start + T, device=dev)
            mask = torch.arange(kv_len, device=dev)[None, :] <= pos[:, None]
            k, v = ks[0][:, :kv_len], vs[0][:, :kv_len]
            kd, vd = kds[0][:, :kv_len], vds[0][:, :kv_len]
            ref = sdpa(q.double(), kd.double(), vd.double(), mask)
            row = {"kv_len": kv_len, "T": T,
                   "err_sdpa_bf16": (sdpa(q, kd, vd, mask).double() - ref).abs().max().item(),
                   "us_sdpa": graph_us(lambda i: sdpa(q, kds[i][:, :kv_len], vds[i][:, :kv_len], mask), layers),
                   "roofline_us": kv_heads * min(kv_len, start + T) * row_bytes / 4.2e12 * 1e6, "configs": {}}
            for c in configs:
                ours = launch(q, k, v, mask, c)
                rec = {"err": (ours.double() - ref).abs().max().item(),
                       "us": graph_us(lambda i: launch(q, ks[i][:, :kv_len], vs[i][:, :kv_len], mask, c), layers)}
                if T == 16:
                    longer = torch.arange(kv_len + 256, device=dev)[None, :] <= pos[:, None]
                    same = same_longer = 0
                    for t in range(T):
                        same += torch.equal(launch(q[:, t:t + 1], k, v, mask[t:t + 1], c)[0], ours[t])
                        alone = launch(q[:, t:t + 1], ks[0][:, :kv_len + 256], vs[0][:, :kv_len + 256],
                                       longer[t:t + 1], c)
                        same_longer += torch.equal(alone[0], ours[t])
                    rec["invariant_tokens"] = f"{same}/{T}"
                    rec["invariant_tokens_longer_kv"] = f"{same_longer}/{T}"
                    if c.block_q != 16 and not c.tma:  # a token alone through the 16-row twins: the same bits?
                        # (then verify passes could take the wide tile and one-token steps a 16-row one)
                        for twin in [x for x in configs if x.block_q == 16 and not x.tma and (x.block_n, x.split,
                                     x.pipelined) == (c.block_n, c.split, c.pipelined)] or [
                                dataclasses.replace(c, block_q=16)]:
                            same_twin = sum(torch.equal(launch(q[:, t:t + 1], k, v, mask[t:t + 1], twin)[0], ours[t])
                                            for t in range(T))
                            rec[f"bits_as_{twin.name}"] = f"{same_twin}/{T}"
                    if c.tma:  # the same values loaded another way: the loads by address' bits?
                        by_address = launch(q, k, v, mask, dataclasses.replace(c, tma=False))
                        rec["bits_as_loads_by_address"] = torch.equal(by_address, ours)
                        invariant[c] &= rec["bits_as_loads_by_address"]
                    invariant[c] &= same == T and same_longer == T
                invariant[c] &= rec["err"] < 4 * row["err_sdpa_bf16"] + 1e-3
                if (kv_len, T) in adopt_on:
                    score[c] += rec["us"]
                row["configs"][c.name] = rec
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del ks, vs, kds, vds
        torch.cuda.empty_cache()
    ok = [c for c in configs if invariant[c]]
    best = min(ok, key=lambda c: score[c]) if ok else None
    results["invariant"] = {c.name: invariant[c] for c in configs}
    results["score_us"] = {c.name: score[c] for c in configs}
    results["adopted"] = dataclasses.asdict(best) if best else None
    (out / "attention.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'kv_len':>7s} {'T':>3s} {'sdpa us':>8s} {'floor':>6s}  " + " ".join(f"{c.name:>15s}" for c in configs))
    for r in results["rows"]:
        print(f"{r['kv_len']:7d} {r['T']:3d} {r['us_sdpa']:8.1f} {r['roofline_us']:6.1f}  "
              + " ".join(f"{r['configs'][c.name]['us']:15.1f}" for c in configs))
    print("invariant and within error:", results["invariant"])
    print("adopted:", best.name if best else None, f"({score[best]:.1f} us over {sorted(adopt_on)})" if best else "")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen")
    ap.add_argument("--cache-types", type=kv_types, default=None, metavar="K,V",
                    help="the caches' KV cache types, e.g. q5_0,q4_1 (default: bf16,bf16)")
    ap.add_argument("--kv-lens", type=key_counts, default=None, metavar="N,N,...",
                    help="key counts to time instead of the shape's (at least 22 each: a 16-token block and its start)")
    args = ap.parse_args()
    main(args.out, args.long, args.shape, args.cache_types or ("bf16", "bf16"), args.kv_lens)
