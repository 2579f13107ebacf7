"""Batch-invariant skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode or verify step.

`skinny_linear(x, weight, bias)` runs a Triton kernel (flashdraft.kernels.skinny_triton) built for M = 1..16:
bf16 (or fp16 / fp32) in and out, fp32 accumulation, every program reading its [BLOCK_N, BLOCK_K] weight tiles
once and using them for all rows of a 16-row tile (rows past M are zero padding; a batched step's more rows take
64-row tiles where the tiling says so, which give each row the same bits), so the cost is nearly flat from M = 1
to 16 (and to 64 with the 64-row tiles) and the weights stream at close to the memory bandwidth.

**Bitwise batch invariance.** Row m of the output depends only on x[m] and W, never on M or on the other rows:
the tiling, the K split and the order in which K is reduced are fixed by (N, K) alone (one config per weight
shape, chosen by `config_for`, never by M; no autotuning at run time; M is not specialized by the compiler; a
split-K second pass adds its partials in a fixed order; no atomics), and a tensor-core product's output row
depends only on its own input row. So every linear layer gives a token bitwise the same output whether it
goes through a 1-token decode step or a 16-token DFlash verify step: the GEMMs are no longer a way for greedy
DFlash output to differ from plain decoding on the GPU. cuBLAS does not promise this: it picks different
kernels (split-K, GEMV, tile shapes) for different M, so a 1-row and a 16-row product can round differently
(docs/performance.md, "Lossless on the GPU"). Bitwise identical logits for the whole pass also need the other ops
to be batch-invariant (layers.decode_attention, layers.qkv_prep).

Use: the layers of a model built with LayerPlan(gemm="triton") (their `Linear`s, and the fused q/k/v and gate/up
projections of Attention and GatedMLP) call `linear()`, which sends inputs of at most the plan's max_rows rows to
the kernel and larger ones (prefill, long context projections) to F.linear. The kernel is registered as the custom op
`flashdraft::skinny_linear` (with a fake implementation), so torch.compile'd layers treat it as one opaque call,
and it neither syncs with the host nor allocates anything but its output (and, for split-K shapes, one fp32
workspace) from the current allocator, so it is safe inside CUDA graph capture.

**Fusions.** Besides its GEMMs, a decoder layer's decode step runs small elementwise kernels (two RMSNorms,
SwiGLU's silu * up, two residual adds) whose launches cost more than their work. The kernel can take them in
(each optional, each batch-invariant too):
- `rms_norm_eps`: an RMSNorm of x, the row scale in the epilogue, the norm's weight folded into W's columns
  beforehand (`fold_norm_weight`): the q/k/v and gate/up projections;
- `gated=True`: W is the fused [gate; up] weight, and the result is silu(gate) * up (gate/up);
- `residual`: the residual stream added to the product (o and down projections).
The fused results are computed in fp32 and rounded once, so they are close to, not bitwise equal to, the unfused
ops of the module-by-module path (DecoderLayer.fused_forward uses them).

Triton is imported on first use only. On CUDA the kernel runs compiled; elsewhere only under Triton's
interpreter (TRITON_INTERPRET=1 set before the first call), which the CPU tests use.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.kernels.runtime import gpu_sm_count, opaque_op
from flashdraft.quant import q4k_columns
from flashdraft.quant.linear import QuantLinear


BLOCK_M = 16  # rows per tile: tl.dot's minimum, and a whole DFlash verify block (B = 16) in one tile


@dataclass(frozen=True)
class SkinnyConfig:
    """One tiling of the kernel. Chosen per weight shape (N, K), never per M (batch invariance)."""

    block_n: int = 32      # output features per program
    block_k: int = 256     # K step (elements) of the inner loop
    split_k: int = 1       # fixed K split (> 1: fp32 partials plus a deterministic reduce kernel)
    num_warps: int = 4
    num_stages: int = 4    # software-pipelining depth of the weight loads
    swap: bool = False     # compute (W x^T)^T: the weight tile is the left tl.dot operand
    pdl: bool = False      # CUDA only: launch as a programmatic dependent launch (Hopper), so the launch
    #                        overlaps the end of the previous kernel; the kernel waits before reading anything
    block_m: int = BLOCK_M  # rows per tile (a tl.dot's rows; 64: a batched pass's rows in one tensor-core product)
    batch_block_m: int = 0  # rows per tile in passes of more than BLOCK_M rows (batched steps'), 0: block_m. Only
    #                        where the wider tiles give every row the bits block_m's give it (measured per tiling:
    #                        scripts/gpu/row_tiles_run.py), so a row's bits still do not depend on the pass's rows

    @property
    def name(self) -> str:
        return (f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"
                + ("x" if self.swap else "") + (f"m{self.block_m}" if self.block_m != BLOCK_M else "")
                + (f"b{self.batch_block_m}" if self.batch_block_m else "")
                + ("+pdl" if self.pdl else ""))


# (N, K) -> the tiling measured fastest (M = 1 plus M = 16) on one H200 (torch 2.11, Triton 3.6) by
# `scripts/gpu/gemm_run.py OUT --sweep`: Qwen3-8B's fused q/k/v, o, fused gate/up, down, LM head, and its
# DFlash drafter's fc and lone k/v projections. Other shapes get the heuristic of `config_for`.
# Batched steps' passes (more than 16 rows) take 64-row tiles where `batch_block_m` says so: on an H100
# (scripts/gpu/row_tiles_run.py, 2026-12-05, docs/performance.md "64-row tiles for batched passes") every 64-row
# tiling gave each row the bits of its 16-row twin, and the weight-on-the-left 64 x 128 tiling, 6 stages, was near
# the fastest at 64 rows for every shape (down 86.4 -> 41.6 us, LM head 722.8 -> 437.1) with its 16-row tiles within
# 1.5 us of the tilings above at 1 and 16 rows, so the down, LM head and drafter fc shapes moved to it.
SWAPPED_BATCH_TILED = SkinnyConfig(64, 128, 1, 4, 6, swap=True, batch_block_m=64)
CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (6144, 4096): SWAPPED_BATCH_TILED,
    (4096, 4096): SWAPPED_BATCH_TILED,
    (24576, 4096): SkinnyConfig(64, 128, 1, 4, 6, swap=True),  # unfused gate/up: its 64-row tiles not measured
    (4096, 12288): SWAPPED_BATCH_TILED,
    (151936, 4096): SWAPPED_BATCH_TILED,
    (4096, 20480): SWAPPED_BATCH_TILED,
    (1024, 4096): SkinnyConfig(32, 64, 4, 4, 8),
}


# The gated (SwiGLU) product's tiling by [2I, K] weight shape, with the row norm, measured on the H200
# (scripts/gpu/fused_gemm_run.py): the fastest tiling whose rows were bitwise batch-invariant, at Qwen3-8B's gate/up
# (51.2 us at M = 1 against 49.4 us for the plain [2I, K] product) and Llama-3.1-8B's (59.8 us against 57.9 us). Other
# shapes get GATED_DEFAULT, the tiling measured at Qwen3's shape then, which the GPU lossless check also runs on its
# tiny float32 models (batch-invariant at both measured shapes; at Llama's 12 us slower than its own). The plain tiling
# with half its stages (n64k128 p3, weight tile on the left) was about 1 us faster but gave rows that differed with M,
# so it is not used. Qwen3-8B's is CONFIGS' batched tiling since the H100's row_tiles_run.py (2026-12-05): 71.1 / 72.0
# us at 1 / 16 rows against 74.0 / 75.5 for the 32 x 64 tiling of four row tiles a program it replaced, 76.1 at 64 rows
# against 99.8, 153.4 at 256 against 296.4; the rows it checked (0, 17, 38, 63, 200, 255) had their bits alone at 1
# to 256 rows.
GATED_CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (24576, 4096): SWAPPED_BATCH_TILED,
    (28672, 4096): SkinnyConfig(64, 128, 1, 4, 4, swap=True),
}
GATED_DEFAULT = SkinnyConfig(32, 64, 1, 4, 8)


# Triton's interpreter runs programs one after another: tile as for one multiprocessor (the fewest, largest tiles)
INTERPRETER_SMS = 1


def config_for(n: int, k: int, sms: int = 132) -> SkinnyConfig:
    """The config for an [n, k] weight: the measured table, else a fixed heuristic of (n, k, SM count) that
    follows what the table's measurements favour:

    - k <= 8192 and at least sms / 2 tiles of 64 rows: 64-row tiles, weight tile as the left tl.dot operand,
      K steps of 128, 6 stages (the q/k/v, o, gate/up shapes);
    - longer k with at least sms tiles of 16 rows: 16-row tiles, 2 warps, 8 stages (down, the drafter's fc);
    - fewer rows: 32-row tiles and a fixed split of K (up to 4 ways) towards 2 programs per SM.
    """
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    block_k = 128 if k >= 128 else max(16, 1 << (k - 1).bit_length())
    if k <= 8192 and -(-n // 64) * 2 >= sms:
        return SkinnyConfig(64, block_k, 1, 4, 6, swap=True)
    if -(-n // 16) >= sms:
        return SkinnyConfig(16, block_k, 1, 2, 8)
    block_k = min(block_k, 64)
    tiles, steps, split = -(-n // 32), -(-k // block_k), 1
    while tiles * split < 2 * sms and split < 4 and steps // (split * 2) >= 4:
        split *= 2
    return SkinnyConfig(32, block_k, split, 4, 8)


def candidate_configs(n: int, k: int, wide: bool = False) -> list[SkinnyConfig]:
    """Tilings worth timing for one shape, config_for's first and its PDL twin second (the GPU script times
    each and prints them; wide: a larger sweep)."""
    first = config_for(n, k)
    out = [first, dataclasses.replace(first, pdl=True),
           SkinnyConfig(64, 128, 1, 4, 6, swap=True), SkinnyConfig(16, 128, 1, 2, 8), SkinnyConfig(64, 128, 1, 4, 6),
           SkinnyConfig(32, 64, 2, 4, 8), SkinnyConfig(64, 256, 1, 4, 4, swap=True), SkinnyConfig(32, 128, 1, 4, 6)]
    loops = [(256, 4, 4, False), (128, 4, 6, False), (512, 8, 3, False), (256, 4, 4, True)]
    if wide:
        loops += [(128, 2, 8, False), (256, 8, 4, False), (512, 4, 3, False), (128, 4, 6, True), (64, 4, 8, False)]
    for block_n, split in ((16, 1), (32, 1), (64, 1), (16, 2), (32, 2), (32, 4), (64, 4)):
        for block_k, warps, stages, swap in loops:
            if block_n == 16 and swap:
                continue
            if -(-k // block_k) < 2 * split:
                continue
            out.append(SkinnyConfig(block_n, block_k, split, warps, stages, swap))
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


# Shared memory one program may use on the H200 (227 KiB a block), less a margin for the epilogue's scratch
SHARED_MEMORY_BYTES = 200 * 1024


def tiling_for_rows(config: SkinnyConfig, m: int) -> SkinnyConfig:
    """The tiling a pass of m rows runs: config, with its batch_block_m-row tiles past BLOCK_M rows (each row the
    bits of config's own tiles: measured per tiling before a table takes it)."""
    if config.batch_block_m and m > BLOCK_M:
        return dataclasses.replace(config, block_m=config.batch_block_m, batch_block_m=0)
    return config


def stages_for(config: SkinnyConfig, element_size: int, gated: bool) -> int:
    """config.num_stages, fewer where a stage's weight and x tiles times the stages would pass the shared memory
    (64-row tiles' x takes four times the 16-row tiles'); at least 2. Pipelining depth only: no change to the
    arithmetic."""
    per_stage = (config.block_n * (2 if gated else 1) + config.block_m) * config.block_k * element_size
    return max(2, min(config.num_stages, SHARED_MEMORY_BYTES // per_stage))


@functools.cache
def _kernels():
    from flashdraft.kernels import skinny_triton
    return skinny_triton


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: SkinnyConfig | None = None, out: torch.Tensor | None = None, *,
           rms_norm_eps: float | None = None, residual: torch.Tensor | None = None,
           gated: bool = False) -> torch.Tensor:
    """Run the kernel: x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype, with skinny_linear's optional
    fusions (no custom-op wrapper). config None = config_for(weight's shape), or GATED_CONFIGS' when gated; norm and
    gated run any config with split_k = 1 (both need the whole K range in one program). Gated: a program covers
    config.block_n gate rows and the same features' up rows. Benchmarks pass a config; the model path goes through
    skinny_linear."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"skinny_linear: x has {k} features, weight is {list(weight.shape)}")
    if gated and rows % 2:
        raise ValueError(f"skinny_linear: gated needs the gate rows stacked over the up rows, [2 * I, K]; "
                         f"weight is {list(weight.shape)} (odd row count)")
    n = rows // 2 if gated else rows
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"skinny_linear: bias is {list(bias.shape)}, weight is {list(weight.shape)}")
    if residual is not None and (residual.shape != (*lead, n) or residual.dtype != x.dtype):
        raise ValueError(f"skinny_linear: residual is {list(residual.shape)} {residual.dtype}, the output is "
                         f"{[*lead, n]} {x.dtype}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    if config is None:
        sms = gpu_sm_count(x.device.index) if x.device.type == "cuda" else INTERPRETER_SMS
        config = GATED_CONFIGS.get((rows, k), GATED_DEFAULT) if gated else config_for(rows, k, sms)
    if rms_norm_eps is not None or gated:
        config = dataclasses.replace(config, split_k=1)
    config = tiling_for_rows(config, m)
    res2 = None
    if residual is not None:
        res2 = residual.reshape(m, n)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    kern = _kernels()
    split = config.split_k
    m_tiles = -(-m // config.block_m)
    stages = stages_for(config, x.element_size(), gated)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    even_k = k % (split * config.block_k) == 0
    pdl = {"launch_pdl": True} if config.pdl and x.device.type == "cuda" else {}
    kern.skinny_gemm_kernel[(m_tiles, -(-n // config.block_n), split)](
        x2, weight, bias if bias is not None else y, y, part,
        res2 if res2 is not None else y, m, n, x2.stride(0), weight.stride(0), y.stride(0),
        res2.stride(0) if res2 is not None else 0, float(rms_norm_eps or 0.0), K=k,
        STEPS=-(-(-(-k // config.block_k)) // split),
        HAS_BIAS=bias is not None, HAS_NORM=rms_norm_eps is not None, HAS_RESIDUAL=res2 is not None, GATED=gated,
        IEEE=x.dtype == torch.float32, SWAP=config.swap,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32, PDL=bool(pdl),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        EVEN_N=n % config.block_n == 0, EVEN_K=even_k, W_EVICT="evict_first" if m_tiles == 1 else "",
        num_warps=config.num_warps, num_stages=stages, **pdl)
    if split > 1:
        block = 1024
        kern.split_reduce_kernel[(-(-n // block), m)](
            part, bias if bias is not None else y, y, m, n, y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=False, SPLIT_K=split, BLOCK=block,
            r_ptr=res2 if res2 is not None else y, stride_rm=res2.stride(0) if res2 is not None else 0,
            HAS_RESIDUAL=res2 is not None, num_warps=4)
    return y.reshape(*lead, n)


def _output_like(x, weight, bias, rms_norm_eps=None, residual=None, gated=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if gated else weight.shape[0]))


@opaque_op("flashdraft::skinny_linear", _output_like)
def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rms_norm_eps: float | None = None, residual: torch.Tensor | None = None,
                   gated: bool = False) -> torch.Tensor:
    return launch(x, weight, bias, rms_norm_eps=rms_norm_eps, residual=residual, gated=gated)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  rms_norm_eps: float | None = None, residual: torch.Tensor | None = None,
                  gated: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) with the batch-invariant Triton kernel (see the module docstring):
    each output row is bitwise independent of how many rows go through together. Meant for few rows (<= 16
    reads the weights once; more rows, a batched step's, take the tiling's 64-row tiles where it has them
    (batch_block_m), else a program per 16-row tile of each weight tile, side by side, so that the others mostly
    find the weight tile in L2). Fusions, all in fp32 with one rounding:

    - rms_norm_eps: x is RMS-normalized first, without a weight: x * rsqrt(mean(x * x) + rms_norm_eps) (an RMSNorm's
      weight goes into W's columns beforehand: fold_norm_weight);
    - gated: weight is [gate; up], [2 * I, K] (bias [2 * I]), and the result [..., I] is silu(gate) * up;
    - residual [..., N] (x's dtype): added to the result.
    """
    return _skinny_linear(x, weight, bias, rms_norm_eps, residual, gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_m: int = 0) -> torch.Tensor:
    """F.linear, except that inputs of 1..max_m rows go to skinny_linear (max_m = 0: always F.linear)."""
    if max_m and math.prod(x.shape[:-1]) <= max_m:
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.no_grad()
def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """W[:, k] *= norm_weight[k] in place (computed in float32, rounded once to W's dtype): W @ (g * x) = (W g) @ x,
    so a GEMM with rms_norm_eps and the folded W computes F.linear(rms_norm(x, g), W) with x going to the tensor
    cores as loaded. The one rounding of each product is the size of the rounding of the normed activation that
    the unfused path does instead."""
    weight.copy_((weight.float() * norm_weight.float()[None, :]).to(weight.dtype))


class Linear(nn.Linear):
    """nn.Linear (the same parameters, so checkpoints load as they are) whose inputs of up to max_rows rows go
    through skinny_linear (max_rows = 0: F.linear always); a model gives it its plan's gemm_rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, max_rows: int = 0, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.max_rows)


@torch.no_grad()
def fuse_rows(parts: list[nn.Module]) -> nn.Module | None:
    """One projection whose output is the parts' outputs side by side (one GEMM or quantized product per pass
    instead of one per part), the parts' weights becoming views of its own, so no memory is added; None where the
    parts cannot be one: plain Linear layers of one input size, dtype and max_rows, all with a bias or none, or
    QuantLinear layers without bias of one GGUF type, input size and compute dtype (a type mix, as Q4_K_S files
    give some layers, stays apart; Q4_K parts kept super-block-major and in GGUF's order are one type: the fused
    weight in GGUF's order, since a part that is not whole chunks cannot be a view of a super-block-major one)."""
    first, biased = parts[0], parts[0].bias is not None
    if all(type(p) is Linear and (p.bias is not None) == biased and p.in_features == first.in_features
           and p.weight.dtype == first.weight.dtype and p.max_rows == first.max_rows for p in parts):
        fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=biased, max_rows=first.max_rows,
                       device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if biased:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        names = ["weight", "bias"] if biased else ["weight"]
    elif all(type(p) is QuantLinear and p.bias is None and (q4k_columns.file_type(p.qtype), p.in_features, p.dtype)
             == (q4k_columns.file_type(first.qtype), first.in_features, first.dtype) for p in parts):
        # Q4_K parts of whole 256-row chunks (super-block-major) beside others (GGUF's order): all in GGUF's order,
        # the parts then of the fused weight's type
        qtype = first.qtype if all(p.qtype == first.qtype for p in parts) else q4k_columns.ROWS_QTYPE
        blocks = [p.blocks if p.qtype == qtype else q4k_columns.to_rows(p.blocks) for p in parts]
        fused = QuantLinear(torch.cat(blocks), qtype, first.in_features, first.dtype)
        for p in parts:
            p.qtype = qtype
        names = ["blocks"]
    else:
        return None
    offset = 0
    for p in parts:
        rows = p.out_features
        for name in names:
            view = getattr(fused, name)[offset:offset + rows]
            setattr(p, name, view if name == "blocks" else nn.Parameter(view, requires_grad=False))
        offset += rows
    return fused


def attach_fused(owner: nn.Module, name: str, parts: list[nn.Module]) -> None:
    """owner.<name> = fuse_rows(parts), held outside the module tree: its weights are the parts' own (the parts hold
    views of them), which parameters(), state_dict() and .to() then see once, as before the fusion."""
    owner.__dict__[name] = fuse_rows(parts)
