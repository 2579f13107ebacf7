"""Would Q4_K in lane order stream faster? kquant_mma.cu's Q4_K loop reads a row's 128 quant bytes as four 8-byte
loads a lane (lane c: bytes 32 gq + 8c of each 32-byte run gq), where lane-order Q6_K (q6k_lanes) reads its
ql / qh / scales as 16-byte loads and streams at 2.8 TB/s on the H100 against Q4_K's ~2.1 (docs/performance.md).
Here the same kernel text with the quant bytes of each super-block permuted so that lane c's 32 bytes lie together
(byte 16 + 32 gq + 8c + b -> 16 + 32c + 8 gq + b) and read as two 16-byte loads, from global memory (direct
tilings) or from the shared-memory ring (ring rows then 144 bytes apart: the 16-byte reads of a quarter-warp
fall on 32 different banks, where the 8-byte layout needed 160). A probe, not a layout of the package: the results
must be the original kernel's bits on the original blocks (the same arithmetic on the same values), then the two
are timed on the adopted tilings of real shapes at 1 and 16 rows of x.

    PYTHONPATH=src python scripts/gpu/q4k_lanes_probe.py OUT [--only gemma-q4k-fused,...]

--only: mma_tilings.py's Q4_K shape sets (default gemma-q4k-fused, gemma-q4k, qwen-q4k-fused). OUT/q4k_lanes.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for, random_blocks  # noqa: E402
from mma_tilings import SETS  # noqa: E402

from flashdraft.quant import mma_kernels  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

QS = 16  # where a Q4_K super-block's quant bytes start
# (old text, new text, times it occurs in kquant_mma.cu): the quant loads of the direct and the ring loops, and the
# ring's row pitch
PATCHES = [
    ("for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = __ldg((const uint2 *)(blk + QS + 32 * gq + 8 * c));",
     "{ const uint4 a = __ldg((const uint4 *)(blk + QS + 32 * c)), b = __ldg((const uint4 *)(blk + QS + 32 * c + 16));"
     " q[r][hh][0] = make_uint2(a.x, a.y); q[r][hh][1] = make_uint2(a.z, a.w);"
     " q[r][hh][2] = make_uint2(b.x, b.y); q[r][hh][3] = make_uint2(b.z, b.w); }", 1),
    ("for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = *(const uint2 *)(blk + QS + 32 * gq + 8 * c);",
     "{ const uint4 a = *(const uint4 *)(blk + QS + 32 * c), b = *(const uint4 *)(blk + QS + 32 * c + 16);"
     " q[r][hh][0] = make_uint2(a.x, a.y); q[r][hh][1] = make_uint2(a.z, a.w);"
     " q[r][hh][2] = make_uint2(b.x, b.y); q[r][hh][3] = make_uint2(b.z, b.w); }", 1),
    ("#define ROWB (QTYPE == 4 ? 160 : 224)", "#define ROWB (QTYPE == 4 ? 144 : 224)", 1),
]


def lanes_source(source: str) -> str:
    for old, new, times in PATCHES:
        if source.count(old) != times:
            raise ValueError(f"{old!r} occurs {source.count(old)} times in the kernel, not {times}")
        source = source.replace(old, new)
    return source


def to_lanes(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K rows [N, nsb * 144] with each super-block's quant bytes in lane order (gq, c, b) -> (c, gq, b)."""
    n, nbytes = blocks.shape
    b = blocks.reshape(n, nbytes // 144, 144)
    quants = b[..., QS:].reshape(n, -1, 4, 4, 8).transpose(2, 3).reshape(n, -1, 128)
    return torch.cat([b[..., :QS], quants], dim=-1).reshape(n, nbytes).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="gemma-q4k-fused,gemma-q4k,qwen-q4k-fused")
    args = ap.parse_args()
    wrong = [name for name in args.only.split(",") if SETS.get(name, ("",))[0] != "Q4_K"]
    if wrong:
        ap.error(f"not Q4_K shape sets of mma_tilings.py: {wrong}")
    args.out.mkdir(parents=True, exist_ok=True)
    text = mma_kernels.SOURCE.read_text()
    lanes = lanes_source(text)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for set_name in args.only.split(","):
        for shape, (n, k) in SETS[set_name][1].items():
            tilings = mma_kernels.tilings_for("Q4_K", n, k)
            ws = [random_blocks("Q4_K", n, k, gen, dev) for _ in range(copies_for(n * row_bytes("Q4_K", k), False))]
            ls = [to_lanes(w) for w in ws]
            x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
            same = all(torch.equal(mma_kernels.launch(x[:m], ws[0], n, "Q4_K", tilings),
                                   mma_kernels.launch(x[:m], ls[0], n, "Q4_K", tilings, source=lanes))
                       for m in (1, 5, 16))
            us = {}
            for form, blocks, source in (("gguf", ws, None), ("lanes", ls, lanes)):
                us[form] = [1000 * bench_ms([lambda w=w, m=m: mma_kernels.launch(x[:m], w, n, "Q4_K", tilings,
                                                                                 source=source) for w in blocks],
                                            False) for m in (1, 16)]
            mb = n * row_bytes("Q4_K", k) / 1e6
            rows.append({"set": set_name, "shape": shape, "n": n, "k": k, "mb": mb, "same_bits": same,
                         "tilings": [str(t) for t in tilings], "us_gguf": us["gguf"], "us_lanes": us["lanes"]})
            print(f"{set_name} {shape:12s} {n}x{k} ({mb:6.1f} MB) same bits {same}: M=1 {us['gguf'][0]:7.2f} -> "
                  f"{us['lanes'][0]:7.2f} us ({mb / us['lanes'][0]:.2f} TB/s), M=16 {us['gguf'][1]:7.2f} -> "
                  f"{us['lanes'][1]:7.2f} us", flush=True)
            del ws, ls
            torch.cuda.empty_cache()
            (args.out / "q4k_lanes.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                 "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
