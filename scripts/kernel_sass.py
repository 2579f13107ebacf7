"""Fingerprints of the quantized-matmul, skinny-GEMM and decode-attention Triton kernels' sm_90 machine code,
compiled offline (no GPU needed): for each quant type and decode form (and Q4_K blocks in 256-row chunks, and the
Q4_K/Q5_K dequantization of prefill passes), for the skinny GEMM's fusion and operand-order variants, and for each
adopted attention tiling, the instruction count, a hash of the instructions
(addresses and line information left out), and registers a thread, stack and shared memory. Run it on two
checkouts and compare: identical fingerprints show that a change to the kernels' source (a helper factored out, a
rename) changed no instruction, so it cannot change their speed; and a tiling's registers say how many of its
programs a multiprocessor holds (a source change that took the 8-warp attention tiling from 107 to 140 registers
halved them, and slowed it by a third: docs/performance.md). The attention kernel is compiled as the GPU runs it,
its pointers and strides specialized as 16-byte aligned (Triton's launch does that for torch's tensors): its
key and value loads become cp.async copies only so.

Usage: python scripts/kernel_sass.py [SRC_DIR] [--row-tile-candidates]   (SRC_DIR: the src/ folder to import
flashdraft from; default this checkout's; --row-tile-candidates: also the 64-row tilings scripts/gpu/row_tiles_run.py
times). Needs Triton with its NVIDIA backend (ptxas and cuobjdump ship with it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

SOURCES = [a for a in sys.argv[1:] if not a.startswith("--")]
SRC = Path(SOURCES[0]) if SOURCES else Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashdraft.kernels import attention_triton  # noqa: E402
from flashdraft.kernels import gguf_triton as tk  # noqa: E402
from flashdraft.kernels import skinny_triton  # noqa: E402
from flashdraft.layers import decode_attention as da  # noqa: E402
from flashdraft.layers import skinny_gemm as sg  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32", "N": "i32",
            "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32"}
DEQUANTIZE = {"w_ptr": "*u8", "out_ptr": "*bf16", "N": "i32", "row_bytes": "i32", "magic": "i32"}
# Gemma-4-31B's K; the tilings the H200 runs (64 x 256 tiles, 4 warps, 3 stages)
COMMON = dict(K=5376, IEEE=False, UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, STEPS=21,
              EVEN_N=True, EVEN_K=True)


def fingerprint(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                aligned: tuple[str, ...] = ()) -> dict:
    """aligned: arguments compiled as 16-byte aligned (pointers) or multiples of 16 (integers)."""
    full = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(inspect.signature(fn.fn).parameters)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                       "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.unlink(f.name)
    code = [re.sub(r"/\*[0-9a-f]{4,5}\*/", "", line).strip() for line in sass.splitlines()
            if re.search(r"/\*[0-9a-f]{4,5}\*/", line)]
    mma = Counter(m.group(0) for line in code if (m := re.search(r"\bHG?MMA\.[0-9A-Za-z.]+", line)))
    return {"instructions": len(code), "sha1": hashlib.sha1("\n".join(code).encode()).hexdigest()[:16],
            "tensor_core": dict(sorted(mma.items())), "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared": kernel.metadata.shared}


SKINNY = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "r_ptr": "*bf16",
          "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_rm": "i32",
          "eps": "fp32"}
ATTENTION = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*u8", "m_ptr": "*fp32",
             "l_ptr": "*fp32", "acc_ptr": "*fp32", "counter_ptr": "*i32", "out_ptr": "*bf16", "seg_ptr": "*i64",
             "T": "i32", "KV_LEN": "i32", "N_SPLITS": "i32", "stride_qh": "i32", "stride_qt": "i32",
             "stride_kh": "i32", "stride_kn": "i32", "stride_vh": "i32", "stride_vn": "i32", "stride_mt": "i32",
             "stride_ot": "i32", "qk_scale": "fp32"}


SKINNY_ALIGNED = tuple(a for a in SKINNY if a.endswith("_ptr") or a.startswith("stride"))


def skinny_fingerprint(c: sg.SkinnyConfig, norm: bool, gated: bool, residual: bool, num_stages: int) -> dict:
    """The skinny GEMM at Qwen3-8B's K (4096) in tiling c with these fusions, one row tile a program; pointers and
    row strides 16-byte aligned, as the launch specializes them for torch's tensors."""
    return fingerprint(skinny_triton.skinny_gemm_kernel, SKINNY, dict(
        K=4096, STEPS=-(-(4096 // c.block_k) // c.split_k), HAS_BIAS=False, HAS_NORM=norm, HAS_RESIDUAL=residual,
        GATED=gated, IEEE=False, SWAP=c.swap, UPCAST=False, PDL=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, SPLIT_K=c.split_k, EVEN_N=True, EVEN_K=True, W_EVICT=""),
        num_warps=c.num_warps, num_stages=num_stages, aligned=SKINNY_ALIGNED)


def skinny_fingerprints() -> dict:
    """64 x 128 tiles, 16-row tiles (one stream's step) and 64-row ones (a batched pass's), the weight tile on either
    side: gate/up with the norm, o/down with the residual, q/k/v with the norm."""
    out = {}
    for swap in (False, True):
        for block_m in (16, 64):
            for name, gated, norm, residual in (("gate/up", True, True, False), ("o/down", False, False, True),
                                                ("q/k/v", False, True, False)):
                key = (f"skinny {name}" + (" swapped" if swap else "")
                       + (f", {block_m}-row tiles" if block_m > 16 else ""))
                out[key] = skinny_fingerprint(sg.SkinnyConfig(64, 128, swap=swap, block_m=block_m), norm, gated,
                                              residual, num_stages=3)
    return out


def row_tile_candidate_fingerprints() -> dict:
    """Each 64-row tiling that scripts/gpu/row_tiles_run.py times, per fusion, at the pipelining depth its launch
    takes (skinny_gemm.stages_for): its tensor-core instructions, registers and shared memory (so programs a
    multiprocessor) before a GPU run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from row_tiles_run import CANDIDATES

    out = {}
    for fusion, norm, gated, residual in (("norm", True, False, False), ("norm+gated", True, True, False),
                                          ("residual", False, False, True), ("", False, False, False)):
        for c in CANDIDATES:
            if norm and c.split_k > 1:
                continue
            out[f"skinny {fusion or 'plain'} {c.name}"] = skinny_fingerprint(c, norm, gated, residual,
                                                                             sg.stages_for(c, 2, gated))
    return out


_GROUPS = {128: 4, 256: 4, 512: 8}  # query heads a kv head: Qwen3-8B's; Gemma 4's full layers' at 512


def attention_fingerprints(segmented: bool) -> dict:
    """Decode attention, each adopted tiling at its head width (Qwen3-8B's group of 4; Gemma 4's 512-wide full
    layers, a group of 8), over a bf16 cache with a mask; one sequence's launch, where the long tilings also take
    their keys and values by tensor descriptors (config_for), or a batched pass's (segmented)."""
    aligned = tuple(a for a in ATTENTION if a.endswith("_ptr")) + (
        "stride_qh", "stride_qt", "stride_kh", "stride_kn", "stride_vh", "stride_vn", "stride_ot")
    long = [c for _, c in da.LONG_CONFIGS]
    tilings = [(128, da.CONFIG)] + [(128, c) for c in long] + [
        (256, da.WIDE_HEAD_CONFIG), (512, da.WIDEST_HEAD_CONFIG), (512, da.WIDEST_LONG_CONFIG)]
    if not segmented:
        tilings += [(128, dataclasses.replace(c, tma=True)) for c in long]
    out = {}
    for hd, c in tilings:
        signature = ATTENTION if not c.tma else dict(ATTENTION, **{
            name: f"tensordesc<bf16[1,{c.block_n},{hd}]>" for name in ("k_ptr", "v_ptr")})
        out[f"attention d{hd} {c.name}" + (" segmented" if segmented else "")] = fingerprint(
            attention_triton.attention_kernel, signature, dict(
                GROUP=_GROUPS[hd], D=hd, HAS_MASK=True, IEEE=False, BLOCK_Q=c.block_q, BLOCK_N=c.block_n,
                SPLIT=c.split, K_FMT=0, V_FMT=0, K_ALIGN=16, V_ALIGN=16, PIPELINED=c.pipelined,
                SEGMENTED=segmented, TMA=c.tma, FEW_ROWS=c.few_rows(hd, _GROUPS[hd])),
            num_warps=c.num_warps, num_stages=c.num_stages,
            aligned=tuple(a for a in aligned if not (c.tma and a in ("k_ptr", "v_ptr"))))
    return out


def main() -> int:
    out = {}
    for qtype, code in tk.QTYPE_CODES.items():
        out[f"{qtype} per-element decode"] = fingerprint(tk._quant_matmul_kernel, POINTERS, dict(COMMON, QTYPE=code))
        if qtype in tk.K_QUANTS:
            out[f"{qtype} packed"] = fingerprint(tk._quant_matmul_packed_kernel, dict(POINTERS, magic="i32"),
                                                 dict(COMMON, QTYPE=code))
    out["Q4_K packed, 256-row chunks"] = fingerprint(tk._quant_matmul_packed_kernel, dict(POINTERS, magic="i32"),
                                                     dict(COMMON, QTYPE=tk.QTYPE_CODES["Q4_K"], CHUNK_ROWS=256))
    for five_bit, chunk_rows in ((False, 0), (True, 0), (False, 256)):
        out[f"{'Q5_K' if five_bit else 'Q4_K'} dequantize{', 256-row chunks' if chunk_rows else ''}"] = fingerprint(
            tk._dequantize_q45_kernel, DEQUANTIZE, dict(FIVE_BIT=five_bit, CHUNK_ROWS=chunk_rows, BLOCK_N=32,
                                                        UPCAST=False))
    out.update(skinny_fingerprints())
    out.update(attention_fingerprints(segmented=False))
    out.update(attention_fingerprints(segmented=True))
    if "--row-tile-candidates" in sys.argv:
        out.update(row_tile_candidate_fingerprints())
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
