"""GGUF quantized weights on the GPU: kernel speed vs the roofline, batch invariance, and a Q4_K_S-shaped
Gemma-4-31B decoding plain and with DFlash (issue #8). One run, about 4 minutes on an H200.

Usage (repo root): PYTHONPATH=src python scripts/gpu/gguf_run.py OUT_DIR [--tiny] [--budget-s S] [--tokens N]
Writes OUT_DIR/gguf.json (rewritten after every stage) and prints a compact table last.

Stages (each one's exceptions are caught and recorded under "errors", and the run carries on):
(a) bandwidth: bf16 read bandwidth (torch.sum over a 2 GiB tensor: bytes read / time) and copy bandwidth (2 GiB
    device-to-device copy: bytes read + written / time), medians of triton.testing.do_bench. The roofline uses
    the larger of the two, so "% of roofline" is never flattered.
(b) kernels: for the Gemma-4-31B linear shapes (sliding q/kv/o, full q/k/o, gate/up, down, the tied LM head) and
    the quant types of a Q4_K_S file (Q4_K; Q5_K for attn_v of layers 0-3 and ffn_down of layers 0-6; Q6_K for
    the tied embedding/LM head; plus Q8_0 at the DFlash drafter's shapes), random but valid GGUF blocks are made
    on the GPU (random quant bytes, small positive fp16 scales). Checked: the Triton kernel against
    dequantize + matmul in fp32 on the same bf16-rounded weights (relative error, fresh random inputs), and bitwise
    batch invariance (rows of the M=16 output == the M=1/2/4/8 outputs and a lone middle row). Timed (median ms
    per call of triton.testing.do_bench over a CUDA graph that calls the kernel on enough weight copies to defeat
    the 60 MB L2): the kernel at M = 1, 2, 4, 8, 16; dequantize + cuBLAS and bf16 cuBLAS at M = 1 and 16; and the
    roofline = quantized bytes / bandwidth.
(c) model: a Gemma-4-31B-shaped dense target (flashdraft.models.gemma4.model) whose projections are QuantLinear with
    random Q4_K_S blocks and whose tied embedding/LM head is one Q6_K table, plus a random Gemma-4-31B DFlash
    drafter (Q5_K blocks, the main type of the walkthrough's Q5_K_M drafter file; --drafter-qtype Q8_0 for
    Q8_0 blocks, --drafter-bf16 for bf16), in the engine with CUDA graphs and an 8K-token context
    allocated. Baseline decode tok/s against its roofline (quantized bytes read per step / bandwidth), then DFlash
    in synthetic oracle mode (bench/oracle.py: the drafter runs, its guesses are replaced by the target's own
    continuation with a planted miss) at tau = 2, 4, 6, 8; step times at a short and at an ~8K-token context; peak
    torch.cuda.max_memory_allocated (must stay under 24 GB = 24e9 bytes).

The random target follows bench/synthetic.py's idea so that plain and DFlash decoding must agree token for token:
the residual stream is dominated by the (scaled) embedding row, since the post-attention/post-MLP norms are tiny,
and the final norm is scaled so that the token's own logit is ~20 and every other is ~N(0, 0.3). The greedy
continuation of token t is then t itself with a huge margin, so bf16 differences between a 1-token and a 16-token
pass can never flip it; every layer still does its full work at the real shapes.

--tiny: the same code paths with tiny shapes on the CPU: Triton kernels under the interpreter (TRITON_INTERPRET=1,
when Triton is installed), wall-clock timings, the model on the dequantize path. For tests, not for numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

GB = 1e9
LIMIT_BYTES = 24e9
SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma-4-31B text config (shared/reference/gemma4.md section 1) and its z-lab DFlash drafter (section 4).
GEMMA4_31B = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                  num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                  global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                  layer_types=[FULL if (i + 1) % 6 == 0 else SLIDING for i in range(60)],
                  final_logit_softcapping=30.0, hidden_size_per_layer_input=0, max_position_embeddings=262144,
                  rms_norm_eps=1e-6, eos_token_id=[1, 106], bos_token_id=2, tie_word_embeddings=True)
DRAFTER_31B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=262144, hidden_size=5376,
                   intermediate_size=10752, num_hidden_layers=5, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=128, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=262144,
                   block_size=16, num_target_layers=60, layer_types=[SLIDING] * 4 + [FULL], sliding_window=2048,
                   use_sliding_window=True, final_logit_softcapping=30.0,
                   dflash_config={"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]})
# Same code paths, tiny: every K a multiple of 256 (K-quant super-blocks), two layer types, a 5-layer drafter.
GEMMA4_TINY = dict(GEMMA4_31B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                   num_global_key_value_heads=1, sliding_window=64,
                   layer_types=[FULL if (i + 1) % 3 == 0 else SLIDING for i in range(6)],
                   max_position_embeddings=4096)
DRAFTER_TINY = dict(DRAFTER_31B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_target_layers=6,
                    layer_types=[SLIDING] * 2 + [FULL], sliding_window=32, max_position_embeddings=4096,
                    dflash_config={"mask_token_id": 4, "target_layer_ids": [1, 4]}, block_size=8)

# [N, K] of every linear layer shape (output features, input features).
SHAPES_31B = {"q_sliding": (8192, 5376), "kv_sliding": (4096, 5376), "o_sliding": (5376, 8192),
              "q_full": (16384, 5376), "k_full": (2048, 5376), "o_full": (5376, 16384),
              "gate_up": (21504, 5376), "down": (5376, 21504), "lm_head": (262144, 5376),
              "d_q": (8192, 5376), "d_kv": (1024, 5376), "d_o": (5376, 8192), "d_gate_up": (10752, 5376),
              "d_down": (5376, 10752), "d_fc": (5376, 32256)}
SHAPES_TINY = {"q_sliding": (128, 256), "kv_sliding": (72, 256), "o_sliding": (64, 256), "q_full": (128, 256),
               "k_full": (64, 256), "o_full": (64, 512), "gate_up": (128, 256), "down": (64, 1024),
               "lm_head": (128, 256), "d_q": (128, 256), "d_kv": (64, 256), "d_o": (64, 256),
               "d_gate_up": (128, 256), "d_down": (64, 512), "d_fc": (64, 768)}
TARGET_SHAPES = ("q_sliding", "kv_sliding", "o_sliding", "q_full", "k_full", "o_full", "gate_up", "down")
DRAFTER_SHAPES = ("d_q", "d_kv", "d_o", "d_gate_up", "d_down", "d_fc")
# Most important first: stage (b) stops adding cases when its time is up.
CASES = ([("Q4_K", s) for s in ("gate_up", "down", "q_sliding", "kv_sliding", "o_sliding")]
         + [("Q6_K_LANES", "lm_head"), ("Q5_K", "down"), ("Q5_K", "kv_sliding")]
         + [("Q4_K", s) for s in ("q_full", "k_full", "o_full")]
         + [("Q8_0", s) for s in DRAFTER_SHAPES]
         + [("Q5_K", "gate_up"), ("Q6_K_LANES", "gate_up")])
# --tiny: one case per quant type, plus a split-K shape (interpreted kernels are slow)
CASES_TINY = [("Q4_K", "gate_up"), ("Q4_K", "down"), ("Q5_K", "kv_sliding"), ("Q6_K_LANES", "lm_head"),
              ("Q8_0", "d_fc")]
M_VALUES = (1, 2, 4, 8, 16)
VARIANT_CASES = 7  # the first cases also time tk_variants' tilings (the fastest correct one is adopted)

# Random blocks: (byte offset of an fp16 scale, its size relative to the block's `scale` argument). The other
# bytes (quants, packed sub-block scales) are uniformly random. dmin ~ 7.5 d (Q4_K) / 15.5 d (Q5_K) centres the
# weights near zero, as the mean quant times the mean 6-bit scale would.
FP16_FIELDS = {"Q4_0": [(0, 1.0)], "Q5_0": [(0, 1.0)], "Q8_0": [(0, 1.0)], "Q4_1": [(0, 1.0), (2, -7.5)],
               "Q5_1": [(0, 1.0), (2, -15.5)], "Q4_K": [(0, 1.0), (2, 7.5)], "Q5_K": [(0, 1.0), (2, 15.5)],
               "Q6_K": [(208, 1.0)]}
# Block scale giving weights of standard deviation ~0.02 (embedding: ~1), by type (weight std / scale).
WEIGHT_STD_PER_SCALE = {"Q4_0": 4.6, "Q5_0": 9.2, "Q8_0": 74.0, "Q4_1": 4.6, "Q5_1": 9.2, "Q4_K": 200.0,
                        "Q5_K": 400.0, "Q6_K": 1370.0}


def log(msg: str) -> None:
    print(msg, flush=True)


class Run:
    """The JSON being built, the deadline, and per-stage error capture."""

    def __init__(self, out: Path, budget_s: float, tiny: bool):
        self.out, self.tiny = out, tiny
        self.t0 = time.time()
        self.deadline = self.t0 + budget_s
        self.budget_s = budget_s
        self.result: dict = {"tiny": tiny, "errors": [], "skipped": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def error(self, stage: str, e: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        self.result["errors"].append({"stage": stage, "error": f"{type(e).__name__}: {e}", "traceback": tb[-3000:]})
        log(f"!! {stage}: {type(e).__name__}: {e}")

    def skip(self, what: str) -> None:
        self.result["skipped"].append(what)
        log(f"-- skipped (time): {what}")

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.time() - self.t0, 1)
        (self.out / "gguf.json").write_text(json.dumps(self.result, indent=2, default=str))


# ---------------------------------------------------------------------------------------------------------------
# helpers


def random_blocks(qtype: str, rows: int, k: int, gen, device, weight_std: float = 0.02):
    """Random valid GGUF blocks uint8 [rows, row_bytes], made on `device`: random quant bytes, fp16 scales small,
    positive (dmin too) and spread over x0.5..x1.5, so weights have about `weight_std` standard deviation.
    Q6_K_LANES: random Q6_K blocks in lane order, as QuantLinear keeps them (the kernels' type)."""
    import torch

    from flashdraft.quant import block_format

    if qtype == "Q6_K_LANES":  # (imported here only: ab_run.sh's baseline trees may predate the layout)
        from flashdraft.quant import q6k_lanes

        return q6k_lanes.from_gguf(random_blocks("Q6_K", rows, k, gen, device, weight_std))

    fmt = block_format(qtype)
    nb = k // fmt.block_elems
    raw = torch.randint(0, 256, (rows, nb, fmt.block_bytes), dtype=torch.uint8, device=device, generator=gen)
    scale = weight_std / WEIGHT_STD_PER_SCALE[qtype]
    for off, rel in FP16_FIELDS[qtype]:
        v = (torch.rand((rows, nb, 1), device=device, generator=gen) + 0.5) * (scale * rel)
        raw[:, :, off:off + 2] = v.half().view(torch.uint8)
    return raw.view(rows, nb * fmt.block_bytes)


def as_loaded(qtype: str, blocks: list, gguf_order: bool = False) -> tuple[list, str]:
    """Random GGUF blocks (each uint8 [rows, row_bytes]) and their type as the loader keeps them: Q4_K of whole
    256-row chunks super-block-major (Q4_K_COLUMNS), unless gguf_order; other types as they are."""
    from flashdraft.quant import q4k_columns  # (imported here only: ab_run.sh's baseline trees may predate it)

    if gguf_order or qtype != q4k_columns.ROWS_QTYPE or not q4k_columns.fits(blocks[0].shape[0]):
        return blocks, qtype
    return [q4k_columns.from_rows(b) for b in blocks], q4k_columns.QTYPE


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def bench_ms(fns, tiny: bool, warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median milliseconds per call of fns (each typically on its own weight copy). CUDA: one CUDA graph calling
    every fn in turn, timed by triton.testing.do_bench (median; it clears the L2 before each replay), divided by
    len(fns). CPU (--tiny): wall clock, median of 3."""
    import torch

    if tiny:
        times = []
        for _ in range(1):
            t = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t) / len(fns))
        return 1000 * statistics.median(times)
    import triton.testing

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms / len(fns)


def copies_for(nbytes: int, tiny: bool, target: int = 512 << 20, cap: int = 64) -> int:
    return 1 if tiny else max(1, min(cap, math.ceil(target / nbytes)))


# ---------------------------------------------------------------------------------------------------------------
# (a) bandwidth


def stage_bandwidth(run: Run, dev) -> float:
    import torch

    nbytes = (64 << 20) if run.tiny else (2 << 30)
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    if run.tiny:
        read_ms = bench_ms([lambda: a.sum()], True)
        copy_ms = bench_ms([lambda: b.copy_(a)], True)
    else:
        import triton.testing
        read_ms = triton.testing.do_bench(lambda: a.sum(), warmup=10, rep=50, return_mode="median")
        copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    read = nbytes / (read_ms / 1000) / GB
    copy = 2 * nbytes / (copy_ms / 1000) / GB
    bw = max(read, copy)
    run.result["bandwidth"] = {"read_gb_s": read, "copy_gb_s": copy, "roofline_gb_s": bw, "bytes": nbytes,
                               "how": "read: torch.sum over a bf16 tensor (bytes read / time); copy: "
                                      "device-to-device copy (bytes read + written / time); medians of "
                                      "triton.testing.do_bench; the roofline uses the larger"}
    log(f"(a) bandwidth: read (sum) {read:.0f} GB/s, copy (read+write) {copy:.0f} GB/s -> roofline uses {bw:.0f} GB/s")
    return bw


# ---------------------------------------------------------------------------------------------------------------
# (b) kernels


def tk_variants(tk, cfg, qtype: str, n: int, k: int, sms: int) -> list:
    """Tilings timed next to the default: the other pipelining depth, 256-wide K steps without pipelining, and
    for the K-quants the packed-word decode's tilings."""
    import dataclasses

    out = [dataclasses.replace(cfg, num_stages=3 if cfg.num_stages == 1 else 1)]
    if k >= 256:
        out.append(tk.heuristic_config(qtype, n, k, sms, num_stages=1, block_k=256))
    if qtype in tk.K_QUANTS:  # packed-word decode, one super-block per K step
        out += [tk.heuristic_config(qtype, n, k, sms, packed=True),
                tk.heuristic_config(qtype, n, k, sms, packed=True, num_stages=1),
                tk.heuristic_config(qtype, n, k, sms, packed=True, block_n=128, num_warps=8, num_stages=1),
                tk.heuristic_config(qtype, n, k, sms, packed=True, block_n=32, num_warps=2, num_stages=1)]
    uniq = []
    for v in out:
        if v != cfg and v not in uniq:
            uniq.append(v)
    return uniq


def kernel_case(run: Run, qtype: str, shape: str, n: int, k: int, bw: float, dev, gen, tk,
                variants: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from flashdraft.quant import dequantize

    rec: dict = {"qtype": qtype, "shape": shape, "n": n, "k": k}
    blocks = random_blocks(qtype, n, k, gen, dev)
    nbytes = blocks.numel()
    cfg = tk.config_for(qtype, n, k, tk.sm_count(dev.index if dev.type == "cuda" else None))
    rec.update(bytes=nbytes, config=cfg.name, roofline_ms=nbytes / (bw * GB) * 1000)
    w = dequantize(blocks, qtype)
    wb = w.to(torch.bfloat16)
    del w
    # correctness: fresh random inputs, against the same bf16-rounded weights in fp32 (no TF32)
    x16 = torch.randn(16, k, device=dev, generator=gen).to(torch.bfloat16)
    y16 = tk.launch(x16, blocks, n, qtype)
    ref = x16.float() @ wb.float().T
    rec["rel_err"] = rel_err(y16, ref)
    rec["finite"] = bool(torch.isfinite(y16).all())
    del ref
    x16b = torch.randn(16, k, device=dev, generator=gen).to(torch.bfloat16)  # a second draw
    rec["rel_err_2"] = rel_err(tk.launch(x16b, blocks, n, qtype), x16b.float() @ wb.float().T)
    if n * k <= (1 << 24):  # fp32 activations: IEEE products (slow path), on the smaller shapes only
        x32 = torch.randn(4, k, device=dev, generator=gen)
        rec["rel_err_fp32"] = rel_err(tk.launch(x32, blocks, n, qtype),
                                      x32.double() @ dequantize(blocks, qtype).double().T)
    # bitwise batch invariance: the rows of the M=16 output whatever M, and a lone middle row
    inv = {str(m): bool(torch.equal(tk.launch(x16[:m], blocks, n, qtype), y16[:m])) for m in (1, 2, 4, 8)}
    inv["row5_alone"] = bool(torch.equal(tk.launch(x16[5:6], blocks, n, qtype), y16[5:6]))
    rec["batch_invariant"] = all(inv.values())
    rec["invariance"] = inv
    yc = F.linear(x16, wb)
    rec["cublas_batch_invariant"] = all(bool(torch.equal(F.linear(x16[:m], wb), yc[:m])) for m in (1, 2, 4, 8))
    del yc, y16
    # timings
    copies = [blocks] + [blocks.clone() for _ in range(copies_for(nbytes, run.tiny) - 1)]
    rec["weight_copies"] = len(copies)
    ms = {}
    for m in M_VALUES:
        xm = x16[:m].contiguous()
        ms[str(m)] = bench_ms([lambda c=c, xm=xm: tk.launch(xm, c, n, qtype) for c in copies], run.tiny)
    rec["ms"] = ms
    if variants:  # other tilings of the same shape, M = 1 and 16 (compare decode formulations and pipelining)
        rec["variants"] = {}
        ref16 = x16.float() @ wb.float().T
        best, best_ms = cfg, ms["16"]
        for var in tk_variants(tk, cfg, qtype, n, k, tk.sm_count(dev.index if dev.type == "cuda" else None)):
            try:
                v = rec["variants"][var.name] = {str(m): bench_ms(
                    [lambda c=c, xm=x16[:m].contiguous(), var=var: tk.launch(xm, c, n, qtype, var) for c in copies],
                    run.tiny) for m in (1, 16)}
                y = tk.launch(x16, blocks, n, qtype, var)
                v["rel_err"] = rel_err(y, ref16)
                v["invariant"] = all(bool(torch.equal(tk.launch(x16[:m], blocks, n, qtype, var), y[:m]))
                                     for m in (1, 2, 4, 8))
                if v["invariant"] and v["rel_err"] < 1e-2 and v["16"] < best_ms:
                    best, best_ms = var, v["16"]
            except Exception as e:  # noqa: BLE001
                rec["variants"][var.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        del ref16
        rec["adopted"] = best.name  # the fastest correct, batch-invariant tiling: the model stage uses it
        rec["adopted_config"] = dataclasses.asdict(best)
        tk.CONFIGS[(qtype, n, k)] = best
    nan = float("nan")
    try:  # the comparisons: one failing must not lose the kernel's numbers
        rec["dequant_cublas_ms"] = {str(m): bench_ms(
            [lambda c=c, xm=x16[:m].contiguous(): F.linear(xm, dequantize(c, qtype).to(torch.bfloat16))
             for c in copies[:2]], run.tiny) for m in (1, 16)}
    except Exception as e:  # noqa: BLE001
        run.error(f"kernel {qtype} {shape}: dequant+cuBLAS timing", e)
        rec["dequant_cublas_ms"] = {"1": nan, "16": nan}
    del copies
    try:
        dense = [wb] + [wb.clone() for _ in range(copies_for(wb.numel() * 2, run.tiny, cap=8) - 1)]
        rec["bf16_cublas_ms"] = {str(m): bench_ms([lambda d=d, xm=x16[:m].contiguous(): F.linear(xm, d)
                                                   for d in dense], run.tiny) for m in (1, 16)}
        del dense
    except Exception as e:  # noqa: BLE001
        run.error(f"kernel {qtype} {shape}: bf16 cuBLAS timing", e)
        rec["bf16_cublas_ms"] = {"1": nan, "16": nan}
    del wb
    rec["frac_roofline_m1"] = rec["roofline_ms"] / ms["1"]
    rec["frac_roofline_m16"] = rec["roofline_ms"] / ms["16"]
    rec["flat_16_over_1"] = ms["16"] / ms["1"]
    rec["gb_s_m1"] = nbytes / (ms["1"] / 1000) / GB
    return rec


def stage_kernels(run: Run, bw: float, dev, gen, stage_deadline: float) -> None:
    import torch

    kernels: list = []
    run.result["kernels"] = kernels
    try:
        from flashdraft.kernels import gguf_triton as tk
    except ImportError as e:  # no Triton on this machine (a CPU CI without it)
        run.result["kernels_unavailable"] = f"{type(e).__name__}: {e}"
        log(f"(b) kernels skipped: Triton unavailable ({e})")
        return
    shapes = SHAPES_TINY if run.tiny else SHAPES_31B
    tol = 1e-2
    for index, (qtype, shape) in enumerate(CASES_TINY if run.tiny else CASES):
        if time.time() > stage_deadline:
            run.skip(f"kernel {qtype} {shape}")
            continue
        n, k = shapes[shape]
        t = time.time()
        try:
            rec = kernel_case(run, qtype, shape, n, k, bw, dev, gen, tk, variants=index < (1 if run.tiny else VARIANT_CASES))
            rec["ok"] = bool(rec["finite"] and rec["rel_err"] < tol and rec["rel_err_2"] < tol
                             and rec.get("rel_err_fp32", 0.0) < 1e-5 and rec["batch_invariant"])
        except Exception as e:  # noqa: BLE001 - one failing kernel must not lose the rest
            run.error(f"kernel {qtype} {shape}", e)
            rec = {"qtype": qtype, "shape": shape, "n": n, "k": k, "ok": False, "error": f"{type(e).__name__}: {e}"}
        rec["stage_s"] = round(time.time() - t, 2)
        kernels.append(rec)
        if "ms" in rec:
            ms = rec["ms"]
            log(f"(b) {qtype} {shape:10s} {n}x{k}: err {rec['rel_err']:.1e} inv {rec['batch_invariant']} "
                f"{rec['config']}  us M=1..16: " + " ".join(f"{1000 * ms[str(m)]:.0f}" for m in M_VALUES)
                + f"  roof {1000 * rec['roofline_ms']:.0f} ({100 * rec['frac_roofline_m1']:.0f}% at M=1)"
                f"  deq+cuBLAS {1000 * rec['dequant_cublas_ms']['1']:.0f}  bf16 {1000 * rec['bf16_cublas_ms']['1']:.0f}"
                f"  [{rec['stage_s']:.1f} s]"
                + "".join(f"\n      variant {name}: " + (v["error"][:120] if "error" in v else
                                                          f"{1000 * v['1']:.0f} / {1000 * v['16']:.0f} us (M=1 / 16)"
                                                          f" err {v['rel_err']:.1e} inv {v['invariant']}")
                          for name, v in rec.get("variants", {}).items())
                + (f"\n      adopted: {rec['adopted']}" if "adopted" in rec else ""))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        run.save()


# ---------------------------------------------------------------------------------------------------------------
# (c) model


def q4_k_s_plan(n_layers: int):
    """llama-quantize's Q4_K_S recipe (shared/reference/gguf-quant.md section 2) as name -> qtype, called in layer
    order: Q4_K, except Q5_K for the first 4 attn_v tensors (llama.cpp counts attn_v tensors; Gemma 4's full layers
    have none, and in the 31B layers 0-3 are sliding) and for ffn_down of the first n_layer/8 layers. The tied
    embedding/LM head (Q6_K) is the caller's."""
    v_seen = []

    def plan(name: str) -> str:
        parts = name.split(".")
        layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1
        if name.endswith("self_attn.v_proj"):
            v_seen.append(name)
            if len(v_seen) <= 4:
                return "Q5_K"
        if name.endswith("mlp.down_proj") and 0 <= layer < n_layers // 8:
            return "Q5_K"
        return "Q4_K"

    return plan


def quantize_linears(model, plan, dev, dtype, gen, weight_std: float = 0.02) -> None:
    """Replace every nn.Linear (built on the meta device) by a QuantLinear holding random blocks of plan(name)."""
    from torch import nn

    from flashdraft.quant import QuantLinear

    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):  # the models' layers.skinny_gemm.Linear is one
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            qtype = plan(name)
            if qtype is None:
                continue
            blocks = random_blocks(qtype, child.out_features, child.in_features, gen, dev, weight_std)
            setattr(parent, child_name, QuantLinear(blocks, qtype, child.in_features, dtype, by_columns=True))


def materialize(model, dev, dtype, gen, fill: dict) -> None:
    """Meta parameters left after quantization become real ones: norms by `fill` (name suffix -> value), other
    float weights (a bf16 drafter's) random N(0, 0.02)."""
    import torch
    from torch import nn

    for mod_name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            t = torch.empty(p.shape, device=dev, dtype=dtype)
            value = next((v for suffix, v in fill.items() if full.endswith(suffix)), None)
            if value is not None:
                t.fill_(value)
            else:
                t.normal_(0, 0.02, generator=gen)
            setattr(mod, pname, nn.Parameter(t, requires_grad=False))


def unique_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen or t.is_meta:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def build_models(run: Run, dev, dtype, gen, capacity: int, drafter_bf16: bool, drafter_qtype: str = "Q5_K",
                 gemm: str | None = None, attention: str | None = None, compile: bool | None = None):
    """The synthetic Gemma-4-31B Q4_K_S target and its drafter, built with the plan the engine resolves for the
    device and these backends (engine.model_prep.resolve_plan)."""
    import torch

    from flashdraft.models.gemma4.config import Gemma4Config, Gemma4DrafterConfig
    from flashdraft.engine.model_prep import resolve_plan
    from flashdraft.models.gemma4.model import Gemma4LM
    from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter
    from flashdraft.quant import QuantEmbedding, QuantLinear, dequantize

    raw = GEMMA4_TINY if run.tiny else GEMMA4_31B
    cfg = Gemma4Config.from_dict(raw, "gemma-4-31b (synthetic)")
    H = cfg.hidden_size
    dcfg = Gemma4DrafterConfig.from_dict(DRAFTER_TINY if run.tiny else DRAFTER_31B, "gemma-4-31b drafter")
    layer_plan = resolve_plan(dev, gemm, attention, compile, dcfg.block_size)
    with torch.device("meta"):
        target = Gemma4LM(cfg, layer_plan)
    plan = q4_k_s_plan(cfg.num_hidden_layers)
    quantize_linears(target.model, lambda name: plan("model." + name), dev, dtype, gen)
    emb = random_blocks("Q6_K", cfg.vocab_size, H, gen, dev, weight_std=1.0)
    target.model.embed_tokens = QuantEmbedding(emb, "Q6_K", H, dtype)
    embed = target.model.embed_tokens  # tied: the same blocks (in lane order, flashdraft.quant.q6k_lanes)
    target.lm_head = QuantLinear(embed.blocks, embed.qtype, H, dtype)
    # tiny post-branch norms: the embedding dominates the residual; the final norm puts the token's own logit at ~20
    rms = float(dequantize(emb[:256], "Q6_K").pow(2).mean().sqrt())
    materialize(target, dev, dtype, gen, {"post_attention_layernorm.weight": 1e-3,
                                          "post_feedforward_layernorm.weight": 1e-3,
                                          "model.norm.weight": 20.0 / (H * rms), "norm.weight": 1.0,
                                          "layer_scalar": 1.0})
    for kind in sorted(set(cfg.layer_types)):
        name = f"{kind}_inv_freq"
        setattr(target, name, getattr(target, name).to(dev))
    target.eval().requires_grad_(False)

    with torch.device("meta"):
        drafter = Gemma4DFlashDrafter(dcfg, capacity, float(target.embed_scale), layer_plan)
    if not drafter_bf16:
        quantize_linears(drafter, lambda name: drafter_qtype, dev, dtype, gen)
    materialize(drafter, dev, dtype, gen, {"norm.weight": 1.0})
    drafter.rope = drafter.rope.__class__(dcfg.layers, capacity).to(dev)
    drafter.eval().requires_grad_(False)

    lm_head = emb.numel()
    target_bytes = unique_bytes(target)
    # Bytes read per target step: every projection's blocks, the LM head's (the same blocks as the embedding, which
    # itself is read one row at a time), the norms: the whole target once. KV-cache reads come on top (small at a
    # short context; the long-context step times show their cost).
    info = {"target_bytes": target_bytes, "lm_head_bytes": lm_head, "target_step_bytes": target_bytes,
            "drafter_bytes": unique_bytes(drafter), "drafter_weights": "bf16" if drafter_bf16 else drafter_qtype,
            "qtypes": sorted({m.qtype for m in target.modules() if isinstance(m, QuantLinear)}),
            "q5_k_tensors": sorted(n for n, m in target.named_modules()
                                   if isinstance(m, QuantLinear) and m.qtype == "Q5_K"),
            "embedding": "Q6_K (tied LM head, same blocks)", "layers": cfg.num_hidden_layers}
    return target, drafter, info


def adopt_tilings(run: Run, dev, *models) -> dict:
    """Shapes the kernel stage did not time take the tiling family (all but the K split, which is re-derived)
    of the tiling adopted for a timed shape of the same quant type. Returns {qtype N x K: tiling name}."""
    from flashdraft.quant import QuantLinear, q4k_columns
    try:
        from flashdraft.kernels import gguf_triton as tk
    except ImportError:
        return {}
    families = {}
    for rec in run.result.get("kernels", []):
        if "adopted_config" in rec:
            families.setdefault(rec["qtype"], rec["adopted_config"])
    sms = tk.sm_count(dev.index if dev.type == "cuda" else None)
    used = {}
    for model in models:
        for m in model.modules():
            if not isinstance(m, QuantLinear):
                continue
            qtype = q4k_columns.file_type(m.qtype)  # the Triton kernels' type (they read Q4_K_COLUMNS as Q4_K)
            key = (qtype, m.out_features, m.in_features)
            f = families.get(qtype)
            if key not in tk.CONFIGS and f is not None:
                tk.CONFIGS[key] = tk.heuristic_config(
                    qtype, m.out_features, m.in_features, sms, block_n=f["block_n"], num_warps=f["num_warps"],
                    num_stages=f["num_stages"], block_k=f["block_k"], packed=f.get("packed", False))
            used[f"{m.qtype} {m.out_features}x{m.in_features}"] = tk.config_for(*key, sms).name
    log("(c) tilings: " + ", ".join(f"{k} {v}" for k, v in sorted(used.items())))
    return used


def other_tensors(dev, *models, top: int = 8) -> dict:
    """Live tensors on dev that are not the models' parameters or buffers (KV caches, graph outputs, anything
    left over), by storage: their total bytes and the largest ones. Finds memory the weights do not explain."""
    import gc

    import torch

    owned = {t.untyped_storage().data_ptr() for m in models for t in list(m.parameters()) + list(m.buffers())}
    seen: dict[int, tuple[int, list[int], str]] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device != dev or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # noqa: BLE001 - objects that only look like tensors, and torch.compile's fake tensors
            continue
        if ptr not in owned and storage.nbytes() > seen.get(ptr, (0,))[0]:
            seen[ptr] = (storage.nbytes(), list(obj.shape), str(obj.dtype).replace("torch.", ""))
    largest = sorted(seen.values(), reverse=True)[:top]
    return {"bytes": sum(v[0] for v in seen.values()), "count": len(seen),
            "largest": [{"bytes": b, "shape": shape, "dtype": dtype} for b, shape, dtype in largest]}


def decode_tok_s(result) -> float:
    s = result.stats
    return (s.predicted_n - 1) / (s.predicted_ms / 1000)


def median_s(fn, dev, reps: int) -> float:
    """Median wall time of fn, run under inference mode as the engine runs its passes (the caches it writes are
    inference tensors, which may not be updated in place outside it)."""
    import torch

    times = []
    with torch.inference_mode():
        fn()
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def stage_model(run: Run, bw: float, dev, gen, args) -> None:
    import torch

    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine
    from flashdraft.bench.oracle import PlantedOracle

    model: dict = {}
    run.result["model"] = model
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    context = 512 if run.tiny else args.context
    memory = model["memory"] = {}  # bytes allocated (live tensors) after each phase, and each phase's peak

    def note_memory(phase: str, *models) -> None:
        """models given: also the live tensors that are not their weights (other_tensors)."""
        if dev.type == "cuda":
            memory[phase] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
            torch.cuda.reset_peak_memory_stats()
        if models:
            memory.setdefault(phase, {})["other_tensors"] = other_tensors(dev, *models)

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    target, drafter, info = build_models(run, dev, dtype, gen, context + 64, args.drafter_bf16, args.drafter_qtype,
                                         gemm=args.gemm, compile=args.compile)
    model.update(info)
    model["build_s"] = round(time.time() - t, 1)
    model["tilings"] = adopt_tilings(run, dev, target, drafter)
    # Making random blocks takes temporaries that loading a file does not: the run's peak is measured from here.
    note_memory("build (random blocks)", target, drafter)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(target, None, drafter, context_size=context, cuda_graphs=dev.type == "cuda",
                    compile=args.compile)
    seq = engine.new_sequence() if engine._sequence is None else engine._sequence
    engine._sequence = seq
    model["context"] = context
    model["kv_cache_bytes"] = seq.target_cache.nbytes() + sum(
        x.numel() * x.element_size() for x in seq.draft_cache.k + seq.draft_cache.v)
    note_memory("engine and caches")
    if dev.type == "cuda":
        model["memory_after_alloc_bytes"] = torch.cuda.memory_allocated()
    step_bytes = model["target_step_bytes"]
    model["roofline_tok_s"] = bw * GB / step_bytes
    log(f"(c) target {info['target_bytes'] / GB:.2f} GB ({', '.join(info['qtypes'])}; LM head "
        f"{info['lm_head_bytes'] / GB:.2f} GB), drafter {info['drafter_bytes'] / GB:.2f} GB "
        f"({info['drafter_weights']}), KV caches {model['kv_cache_bytes'] / GB:.2f} GB at {context} tokens; "
        f"roofline {model['roofline_tok_s']:.1f} tok/s; built in {model['build_s']} s")
    run.save()

    B = drafter.block_size
    prompt = list(range(10, 42))
    params = SamplingParams(max_tokens=args.tokens if not run.tiny else 24, ignore_eos=True)
    t = time.time()
    engine.generate(prompt, params, 0)  # warm-up: captures the decode graphs
    base = engine.generate(prompt, params, 0)
    tok_s = decode_tok_s(base)
    model.update(baseline_tok_s=tok_s, baseline_gb_s=tok_s * step_bytes / GB,
                 baseline_frac_roofline=tok_s / model["roofline_tok_s"], tokens=len(base.tokens),
                 distinct_tokens=len(set(base.tokens)))
    log(f"(c) baseline {tok_s:.1f} tok/s = {tok_s * step_bytes / GB:.0f} GB/s, "
        f"{100 * model['baseline_frac_roofline']:.0f}% of roofline [{time.time() - t:.1f} s]")
    run.save()
    note_memory("baseline decoding (graph capture included)")

    decoder = engine.decoder
    reference = prompt + base.tokens
    try:
        decoder.prefill(seq, prompt, params, 0)
        start = len(prompt)
        reps = 3 if run.tiny else 20
        model["decode_step_ms"] = 1000 * median_s(lambda: decoder.target_pass(seq, torch.tensor([1], device=dev), start),
                                                  dev, reps)
        model["verify_step_ms"] = 1000 * median_s(lambda: decoder.target_pass(seq, torch.arange(B, device=dev), start),
                                                  dev, reps)
        model["draft_step_ms"] = 1000 * median_s(lambda: decoder.draft(seq, B - 1), dev, reps)
        log(f"(c) steps at {start} tokens: decode {model['decode_step_ms']:.2f} ms, verify ({B} tokens) "
            f"{model['verify_step_ms']:.2f} ms, draft {model['draft_step_ms']:.2f} ms")
    except Exception as e:  # noqa: BLE001
        run.error("model step times", e)
    run.save()

    dflash: list = []
    model["dflash"] = dflash
    draft_bytes = model["drafter_bytes"] + model["lm_head_bytes"]  # the drafter's logits go through the LM head
    # DFlash generates in a sequence made with the oracle, in the place of the plain one (one sequence's caches
    # are held at a time), and the long-context steps below in a plain one again (the oracle's reference ends
    # long before their positions).
    oracle = planted = seq = engine._sequence = None
    for tau in (2, 4, 6, 8):
        if run.left() < (25 if not run.tiny else 0):
            run.skip(f"dflash tau {tau}")
            continue
        try:
            t = time.time()
            accept = min(tau - 1, B - 1)
            if oracle is None:
                oracle = PlantedOracle(reference, lambda s, k=accept: k, target.config.vocab_size, dev)
                planted = engine.new_sequence(oracle=oracle)
            oracle.replan(lambda s, k=accept: k)  # one oracle: the step graphs captured with it serve every tau
            engine.generate(prompt, params, B - 1, sequence=planted)  # untimed: any verify length it needs
            oracle.reset()
            out = engine.generate(prompt, params, B - 1, sequence=planted)
            d_tok_s = decode_tok_s(out)
            roof = (accept + 1) * bw * GB / (step_bytes + draft_bytes)
            row = {"tau_planned": accept + 1, "tau": out.stats.tau, "tok_s": d_tok_s,
                   "speedup": d_tok_s / tok_s, "roofline_tok_s": roof, "frac_roofline": d_tok_s / roof,
                   "identical": out.tokens == base.tokens}
            dflash.append(row)
            log(f"(c) DFlash tau {row['tau']:.2f}: {d_tok_s:.1f} tok/s, {row['speedup']:.2f}x baseline, "
                f"{100 * row['frac_roofline']:.0f}% of its roofline {roof:.0f}; same tokens: {row['identical']} "
                f"[{time.time() - t:.1f} s]")
        except Exception as e:  # noqa: BLE001
            run.error(f"dflash tau {tau}", e)
        run.save()

    # step times with the context nearly full (~8K tokens): full layers read every cached row. The rows past the
    # prompt were never written (zeros): the work and the bytes are those of a real long context.
    oracle = planted = None
    seq = engine.new_sequence()
    if run.left() > (15 if not run.tiny else 0):
        try:
            long_start = context - 2 * B
            decoder.prefill(seq, prompt, params, 0)
            seq.tokens = seq.tokens + [seq.tokens[-1]] * (long_start + 1 - len(seq.tokens))
            reps = 3 if run.tiny else 10
            model["long_context_tokens"] = long_start
            model["long_decode_step_ms"] = 1000 * median_s(
                lambda: decoder.target_pass(seq, torch.tensor([1], device=dev), long_start), dev, reps)
            model["long_verify_step_ms"] = 1000 * median_s(
                lambda: decoder.target_pass(seq, torch.arange(B, device=dev), long_start), dev, reps)
            model["long_draft_step_ms"] = 1000 * median_s(lambda: decoder.draft(seq, B - 1), dev, reps)
            log(f"(c) steps at {long_start} tokens: decode {model['long_decode_step_ms']:.2f} ms, verify "
                f"{model['long_verify_step_ms']:.2f} ms, draft {model['long_draft_step_ms']:.2f} ms")
        except Exception as e:  # noqa: BLE001
            run.error("model long-context steps", e)
    else:
        run.skip("long-context step times")
    note_memory("DFlash decoding and long-context steps", target, drafter)
    if dev.type == "cuda":
        # The run's peak: the largest phase peak after the random blocks were made (weights, caches, graphs and
        # activations; what loading a GGUF file and decoding need).
        peak = max(v["peak"] for phase, v in memory.items() if not phase.startswith("build"))
        model["max_memory_allocated_bytes"] = peak
        model["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        model["memory_under_24gb"] = peak < LIMIT_BYTES
        log("(c) memory by phase (GB allocated after / peak during): " + "; ".join(
            f"{phase} {v['allocated'] / GB:.2f} / {v['peak'] / GB:.2f}" for phase, v in memory.items()))
        for phase, v in memory.items():
            if "other_tensors" in v:
                o = v["other_tensors"]
                log(f"(c) after {phase}: {o['bytes'] / GB:.2f} GB in {o['count']} tensors besides the weights; "
                    "largest: " + ", ".join(f"{t['bytes'] / GB:.3f} GB {t['dtype']}{t['shape']}" for t in o["largest"]))
        log(f"(c) peak memory: allocated {peak / GB:.2f} GB ({peak / 2**30:.2f} GiB), reserved "
            f"{model['max_memory_reserved_bytes'] / GB:.2f} GB; under 24 GB: {model['memory_under_24gb']}")
    run.save()


# ---------------------------------------------------------------------------------------------------------------


def summary(run: Run) -> None:
    r = run.result
    kernels = [k for k in r.get("kernels", []) if "ms" in k]
    checks = {
        "kernels_run": len(kernels),
        "kernels_correct": bool(kernels) and all(k["rel_err"] < 1e-2 and k["rel_err_2"] < 1e-2 and k["finite"]
                                                 for k in kernels),
        "kernels_batch_invariant": bool(kernels) and all(k["batch_invariant"] for k in kernels),
        "kernel_failures": [f"{k['qtype']} {k['shape']}" for k in r.get("kernels", []) if not k.get("ok")],
    }
    m = r.get("model", {})
    if "dflash" in m:
        checks["dflash_identical"] = bool(m["dflash"]) and all(d["identical"] for d in m["dflash"])
    if "memory_under_24gb" in m:
        checks["memory_under_24gb"] = m["memory_under_24gb"]
    checks["errors"] = len(r["errors"])
    r["checks"] = checks
    run.save()

    lines = ["", "=" * 118, f"GGUF on {r.get('device')} (torch {r.get('torch')}, triton {r.get('triton')}); "
             f"roofline bandwidth {r.get('bandwidth', {}).get('roofline_gb_s', 0):.0f} GB/s "
             f"(read {r.get('bandwidth', {}).get('read_gb_s', 0):.0f}, copy {r.get('bandwidth', {}).get('copy_gb_s', 0):.0f})",
             f"{'kernel':6s} {'shape':10s} {'N x K':>13s} {'MB':>6s} {'err':>7s} {'inv':>3s} "
             f"{'us M=1':>7s} {'2':>5s} {'4':>5s} {'8':>5s} {'16':>5s} {'16/1':>5s} {'roof':>5s} {'%roof':>5s} "
             f"{'deq1':>6s} {'deq16':>6s} {'bf16_1':>6s} {'bf16_16':>7s} {'cuBLASinv':>9s}"]
    for k in r.get("kernels", []):
        if "ms" not in k:
            lines.append(f"{k['qtype']:6s} {k['shape']:10s} FAILED: {k.get('error', '?')[:90]}")
            continue
        ms = k["ms"]
        lines.append(
            f"{k['qtype']:6s} {k['shape']:10s} {k['n']:>6d}x{k['k']:<6d} {k['bytes'] / 1e6:6.1f} {k['rel_err']:7.1e} "
            f"{'yes' if k['batch_invariant'] else 'NO':>3s} "
            + " ".join(f"{1000 * ms[str(mm)]:{7 if mm == 1 else 5}.0f}" for mm in M_VALUES)
            + f" {k['flat_16_over_1']:5.2f} {1000 * k['roofline_ms']:5.0f} {100 * k['frac_roofline_m1']:4.0f}% "
            f"{1000 * k['dequant_cublas_ms']['1']:6.0f} {1000 * k['dequant_cublas_ms']['16']:6.0f} "
            f"{1000 * k['bf16_cublas_ms']['1']:6.0f} {1000 * k['bf16_cublas_ms']['16']:7.0f} "
            f"{'yes' if k['cublas_batch_invariant'] else 'no':>9s}")
    if m:
        lines.append("-" * 118)
        if "baseline_tok_s" in m:
            lines.append(f"model (Q4_K_S-shaped Gemma-4-31B, random blocks): target {m['target_bytes'] / GB:.2f} GB, "
                         f"drafter {m['drafter_bytes'] / GB:.2f} GB ({m['drafter_weights']}); baseline "
                         f"{m['baseline_tok_s']:.1f} tok/s = {100 * m['baseline_frac_roofline']:.0f}% of roofline "
                         f"{m['roofline_tok_s']:.1f} tok/s")
        if "decode_step_ms" in m:
            lines.append(f"steps: decode {m['decode_step_ms']:.2f} ms, verify {m['verify_step_ms']:.2f} ms, draft "
                         f"{m['draft_step_ms']:.2f} ms"
                         + (f"; at {m['long_context_tokens']} tokens: decode {m['long_decode_step_ms']:.2f}, verify "
                            f"{m['long_verify_step_ms']:.2f}, draft {m['long_draft_step_ms']:.2f} ms"
                            if "long_decode_step_ms" in m else ""))
        for d in m.get("dflash", []):
            lines.append(f"DFlash tau {d['tau']:.2f}: {d['tok_s']:7.1f} tok/s  {d['speedup']:.2f}x baseline  "
                         f"{100 * d['frac_roofline']:.0f}% of roofline {d['roofline_tok_s']:.0f}  identical "
                         f"{d['identical']}")
        if "max_memory_allocated_bytes" in m:
            lines.append(f"memory: peak allocated {m['max_memory_allocated_bytes'] / GB:.2f} GB at {m['context']} "
                         f"tokens of context (limit 24 GB): {'OK' if m['memory_under_24gb'] else 'OVER'}")
    lines.append(f"checks: {json.dumps(checks)}; skipped: {len(r['skipped'])}; {r['elapsed_s']} s")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (interpreter); for tests")
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop adding work after this many seconds")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per decoding run")
    ap.add_argument("--context", type=int, default=8192, help="context allocated for the model stage")
    ap.add_argument("--drafter-bf16", action="store_true", help="bf16 drafter weights instead of quant blocks")
    ap.add_argument("--drafter-qtype", default="Q5_K", choices=["Q5_K", "Q8_0", "Q4_K", "Q6_K"],
                    help="quant type of the drafter's blocks (default Q5_K, as the walkthrough's Q5_K_M file)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="leave the target's and the drafter's layers uncompiled (Engine compiles them on CUDA)")
    ap.add_argument("--configs", type=Path, default=None,
                    help="gguf_sweep.py's gguf_configs.json: measured tilings for the shapes it lists")
    ap.add_argument("--mma-tilings", type=Path, default=None,
                    help="mma_tilings.py's mma_tilings.json: its best tilings for the CUDA k-quant kernel's shapes")
    ap.add_argument("--gemm", default=None, help="Engine's gemm backend for float layers, where supported")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton kernels
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget_s, args.tiny)

    import torch

    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu" and not args.tiny:
        log("no CUDA device: running the --tiny path instead")
        args.tiny = run.tiny = run.result["tiny"] = True
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        run.result["triton"] = triton.__version__
    except ImportError:
        run.result["triton"] = None
    run.result.update(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      sms=torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.configs is not None:
        try:
            from flashdraft.kernels import gguf_triton as tk
            for row in json.loads(args.configs.read_text()):
                row = dict(row)
                key = (row.pop("qtype"), row.pop("n"), row.pop("k"))
                tk.CONFIGS[key] = tk.QuantConfig(**row)
            run.result["configs_from"] = str(args.configs)
            run.result["configs"] = {f"{q} {n}x{k}": c.name for (q, n, k), c in tk.CONFIGS.items()}
            log(f"tilings from {args.configs}: {run.result['configs']}")
        except Exception as e:  # noqa: BLE001
            run.error("configs", e)
    if args.mma_tilings is not None:
        try:
            from flashdraft.quant import mma_kernels, q4k_columns
            for entry in json.loads(args.mma_tilings.read_text())["table"].values():
                few, many = (mma_kernels.MmaTiling(*tiling) for tiling in entry["tilings"])
                # keyed by the file's type, as tilings_for looks them up (a sweep in the package's layout says
                # Q4_K_COLUMNS)
                qtype = q4k_columns.file_type(entry.get("qtype", "Q4_K"))
                mma_kernels.TILINGS[(qtype, entry["n"], entry["k"])] = (few, many)
            run.result["mma_tilings"] = {f"{q} {n}x{k}": str(t) for (q, n, k), t in mma_kernels.TILINGS.items()}
            log(f"k-quant kernel tilings from {args.mma_tilings}: {run.result['mma_tilings']}")
        except Exception as e:  # noqa: BLE001
            run.error("mma_tilings", e)
    bw = 0.0
    try:
        bw = stage_bandwidth(run, dev)
    except Exception as e:  # noqa: BLE001
        run.error("bandwidth", e)
        bw = 4000.0 if dev.type == "cuda" else 10.0
        run.result["bandwidth"] = {"roofline_gb_s": bw, "assumed": True}
    run.save()
    if not args.skip_kernels:
        share = 0.3 if args.skip_model else 0.45
        try:
            stage_kernels(run, bw, dev, gen, time.time() + share * max(0.0, run.left()) if not args.skip_model
                          else run.deadline)
        except Exception as e:  # noqa: BLE001
            run.error("kernels", e)
        run.save()
    if not args.skip_model:
        try:
            stage_model(run, bw, dev, gen, args)
        except Exception as e:  # noqa: BLE001
            run.error("model", e)
        run.save()
    summary(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
