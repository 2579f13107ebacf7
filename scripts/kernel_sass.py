"""Fingerprints of the quantized-matmul and skinny-GEMM Triton kernels' sm_90 machine code, compiled offline (no GPU
needed): for each quant type and decode form, and for the skinny GEMM's fusion and operand-order variants, the
instruction count and a hash of the instructions (addresses and line information left out). Run it on two checkouts
and compare: identical fingerprints show that a change to the kernels' source (a helper factored out, a rename)
changed no instruction, so it cannot change their speed.

Usage: python scripts/kernel_sass.py [SRC_DIR]   (SRC_DIR: the src/ folder to import flashdraft from; default
this checkout's). Needs Triton with its NVIDIA backend (ptxas and cuobjdump ship with it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashdraft.kernels import gguf_triton as tk  # noqa: E402
from flashdraft.kernels import skinny_triton  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32", "N": "i32",
            "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32"}
# Gemma-4-31B's K; the tilings the H200 runs (64 x 256 tiles, 4 warps, 3 stages)
COMMON = dict(K=5376, IEEE=False, UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, STEPS=21,
              EVEN_N=True, EVEN_K=True)


def fingerprint(fn, signature: dict, constexprs: dict) -> dict:
    full = dict(signature, **{k: "constexpr" for k in constexprs})
    kernel = triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    code = [re.sub(r"/\*[0-9a-f]{4}\*/", "", line).strip() for line in sass.splitlines()
            if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    return {"instructions": len(code), "sha1": hashlib.sha1("\n".join(code).encode()).hexdigest()[:16]}


def main() -> int:
    out = {}
    for qtype, code in tk.QTYPE_CODES.items():
        out[f"{qtype} per-element decode"] = fingerprint(tk._quant_matmul_kernel, POINTERS, dict(COMMON, QTYPE=code))
        if qtype in tk.K_QUANTS:
            out[f"{qtype} packed"] = fingerprint(tk._quant_matmul_packed_kernel, dict(POINTERS, magic="i32"),
                                                 dict(COMMON, QTYPE=code))
    # the skinny GEMM at Qwen3-8B's K, 64 x 128 tiles: gate/up with the norm, o/down with the residual, q/k/v
    skinny = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32",
              "r_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
              "stride_rm": "i32", "eps": "fp32"}
    for swap in (False, True):
        for name, gated, norm, residual in (("gate/up", True, True, False), ("o/down", False, False, True),
                                            ("q/k/v", False, True, False)):
            key = f"skinny {name}" + (" swapped" if swap else "")
            out[key] = fingerprint(skinny_triton.skinny_gemm_kernel, skinny, dict(
                K=4096, STEPS=32, HAS_BIAS=False, HAS_NORM=norm, HAS_RESIDUAL=residual, GATED=gated, IEEE=False,
                SWAP=swap, UPCAST=False, PDL=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, EVEN_N=True,
                EVEN_K=True))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
