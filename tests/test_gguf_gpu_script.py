"""scripts/gpu/gguf_run.py --tiny: the GPU run's code paths on tiny shapes on the CPU (Triton kernels under the
interpreter when Triton is installed, the model on the dequantize path), so the one GPU run does not fail on a bug
that a CPU could have shown. Checks the JSON's fields and that its correctness and invariance checks passed."""
import concurrent.futures
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "gguf_run.py"


def _has_triton() -> bool:
    # found, not imported: importing Triton here, without TRITON_INTERPRET, would fix its mode for this process
    return importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf_run")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--tiny", "--budget-s", "600"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gguf.json").read_text())
    data["_stdout"] = proc.stdout
    return data


def test_runs_without_errors_and_prints_the_table(report):
    assert report["tiny"] is True and report["device"] == "cpu"
    assert report["errors"] == [], report["errors"]
    assert report["skipped"] == []
    assert "checks:" in report["_stdout"].splitlines()[-1]
    bw = report["bandwidth"]
    assert bw["read_gb_s"] > 0 and bw["copy_gb_s"] > 0 and bw["roofline_gb_s"] == max(bw["read_gb_s"], bw["copy_gb_s"])


@pytest.mark.skipif(not _has_triton(), reason="the kernel stage needs Triton (its interpreter on the CPU)")
def test_kernels_are_correct_and_batch_invariant(report):
    kernels = report["kernels"]
    assert {k["qtype"] for k in kernels} == {"Q4_K", "Q5_K", "Q6_K_LANES", "Q8_0"}
    assert any(k["config"] != kernels[0]["config"] and "s1" not in k["config"] for k in kernels), \
        "no split-K case ran"
    for k in kernels:
        assert k["ok"], k
        assert k["finite"] and 0 < k["rel_err"] < 1e-2 and 0 < k["rel_err_2"] < 1e-2
        assert k.get("rel_err_fp32", 0.0) < 1e-5
        assert k["batch_invariant"] and all(k["invariance"].values())
        assert set(k["ms"]) == {"1", "2", "4", "8", "16"} and all(v > 0 for v in k["ms"].values())
        assert set(k["dequant_cublas_ms"]) == set(k["bf16_cublas_ms"]) == {"1", "16"}
        assert k["roofline_ms"] > 0 and k["bytes"] > 0
    checks = report["checks"]
    assert checks["kernels_correct"] and checks["kernels_batch_invariant"] and checks["kernel_failures"] == []


def test_model_decodes_plain_and_with_dflash(report):
    m = report["model"]
    # Q4_K of whole 256-row chunks kept super-block-major, the others in GGUF's order; Q6_K in lane order
    assert m["qtypes"] == ["Q4_K", "Q4_K_COLUMNS", "Q5_K", "Q6_K_LANES"]
    # Q4_K_S: Q5_K for attn_v of layers 0-3 (the tiny model's first 4 v_proj are in layers 0, 1, 3, 4: layer 2 is
    # full, with k_eq_v) and for ffn_down of the first n_layer / 8 layers (none of 6)
    assert m["q5_k_tensors"] == [f"model.layers.{i}.self_attn.v_proj" for i in (0, 1, 3, 4)]
    assert m["drafter_weights"] == "Q5_K" and m["drafter_bytes"] > 0  # the walkthrough drafter's type
    assert m["target_step_bytes"] == m["target_bytes"] > m["lm_head_bytes"] > 0
    assert m["baseline_tok_s"] > 0 and m["roofline_tok_s"] > 0
    assert m["decode_step_ms"] > 0 and m["verify_step_ms"] > 0 and m["draft_step_ms"] > 0
    assert m["long_decode_step_ms"] > 0 and m["long_context_tokens"] > 400
    assert [d["tau_planned"] for d in m["dflash"]] == [2, 4, 6, 8]
    for d in m["dflash"]:
        assert d["identical"], d
        assert d["tau_planned"] - 1 < d["tau"] <= d["tau_planned"]  # the last step may be cut short
        assert d["tok_s"] > 0 and d["roofline_tok_s"] > 0
    assert report["checks"]["dflash_identical"]
    # the memory census: after decoding, the tensors besides the weights include the KV caches
    after = m["memory"]["DFlash decoding and long-context steps"]["other_tensors"]
    assert after["bytes"] >= m["kv_cache_bytes"] > 0 and after["largest"][0]["bytes"] > 0
    assert m["memory"]["build (random blocks)"]["other_tensors"]["bytes"] < after["bytes"]


KERNEL_CHECK = r"""
import dataclasses, sys
import torch
sys.path.insert(0, sys.argv[1])
from flashdraft.quant import QUANT_FORMATS, dequantize
from flashdraft.kernels import gguf_triton as tk
from flashdraft.quant import gpu_kernels, q4k_columns
from flashdraft.quant.formats import row_bytes
from test_gguf_quant import random_blocks

assert tk._interpreting()
failures = []
for qtype in ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K_LANES"]:
    elems = 256 if qtype in tk.K_QUANTS else QUANT_FORMATS[qtype].block_elems
    n, k = 40, 2 * 256  # 40 rows: a partial N-tile
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // elems, seed=3))
    w = dequantize(blocks, qtype)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(0))  # 17 rows: two M-tiles
    base = tk.QuantConfig(64, 128, 1, 4, 3)
    configs = [base]
    if qtype in ("Q4_K", "Q8_0"):  # the K split, and 256-wide K steps
        configs += [dataclasses.replace(base, split_k=2), tk.QuantConfig(64, 256, 2, 4, 1)]
    if qtype in tk.K_QUANTS:  # the packed-word decode: a K split with a ragged N-tile; two super-blocks a K step
        configs += [tk.QuantConfig(32, 256, 2, 4, 3, packed=True)]
        if qtype == "Q4_K":
            configs += [tk.QuantConfig(64, 512, 1, 4, 1, packed=True)]
        # each packed weight bitwise the dequantized one: one-hot fp32 rows pick single weights out of the first
        # super-block, at K positions covering every (byte, nibble, group) field
        idx = torch.arange(16) * 17 % 256
        first = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=1, seed=5))
        one = tk.launch(torch.eye(256)[idx], first, n, qtype, tk.QuantConfig(32, 256, packed=True))
        if not torch.equal(one, dequantize(first, qtype)[:, idx].T):
            failures.append((qtype, "packed weights not bitwise the dequantized ones"))
        # the x permutation the packed kernel reads: a permutation of range(K), the same one within every
        # super-block, cached (the one-hot check above shows it matches the kernel's field order)
        perm = tk._packed_perm(qtype, k, x.device)
        if perm.dtype != torch.int64 or not torch.equal(perm.sort().values, torch.arange(k)) \
                or not torch.equal(perm[256:] - 256, perm[:256]) or tk._packed_perm(qtype, k, x.device) is not perm:
            failures.append((qtype, "packed x permutation"))
    ref = x.double() @ w.double().T
    xb = x.bfloat16()
    ref_b = xb.double() @ w.bfloat16().double().T
    for cfg in configs:
        y = tk.launch(x, blocks, n, qtype, cfg)
        if not ((y.double() - ref).norm() / ref.norm()).item() < 1e-5:
            failures.append((qtype, cfg.name, "fp32 error"))
        yb = tk.launch(xb, blocks, n, qtype, cfg)
        if yb.dtype != torch.bfloat16 or not ((yb.double() - ref_b).norm() / ref_b.norm()).item() < 4e-3:
            failures.append((qtype, cfg.name, "bf16 error"))
        for m in (1,):
            if not torch.equal(tk.launch(xb[:m], blocks, n, qtype, cfg), yb[:m]):
                failures.append((qtype, cfg.name, f"M={m} not bitwise"))
        if not torch.equal(tk.launch(xb[16:], blocks, n, qtype, cfg), yb[16:]):
            failures.append((qtype, cfg.name, "second M-tile alone not bitwise"))
        if cfg.packed:  # a row stride past K (x not copied before the permutation): the same rows, bitwise
            xs = torch.cat([xb[:3], xb[:3]], 1)[:, :k]
            if not torch.equal(tk.launch(xs, blocks, n, qtype, cfg), yb[:3]):
                failures.append((qtype, cfg.name, "strided x not bitwise"))
    if tuple(gpu_kernels.KERNELS[qtype](xb[:3], blocks, n).shape) != (3, n):
        failures.append((qtype, "KERNELS shape"))
packed = tk.heuristic_config("Q6_K_LANES", 40, 512, packed=True)
if not (packed.packed and packed.block_k == 256 and packed.name.endswith("q")):
    failures.append(("heuristic packed config", packed))
if tk.heuristic_config("Q8_0", 40, 512, packed=True).packed or tk.heuristic_config("Q4_K", 40, 512).packed:
    failures.append(("packed where it does not apply, or heuristic_config's own default",))
try:
    tk.launch(torch.zeros(1, 64), torch.zeros(8, 68, dtype=torch.uint8), 8, "Q8_0", tk.QuantConfig(packed=True))
    failures.append(("packed Q8_0 accepted",))
except ValueError:
    pass
for (qtype, n, k), cfg in tk.CONFIGS.items():  # the measured table: tilings the kernel can run for its shape
    steps = k // cfg.block_k
    if k % cfg.block_k or steps % cfg.split_k or (qtype in tk.K_QUANTS and cfg.block_k % 256) \
            or tk.config_for(qtype, n, k) is not cfg:
        failures.append(("measured tiling unusable", qtype, n, k, cfg.name))
dflt = tk.config_for("Q4_K", 40, 512)
if (dflt.block_k, dflt.num_stages, dflt.packed) != (256, 3, True):
    failures.append(("K-quant default is not the packed 256-wide tiling, 3 stages", dflt.name))
if tk.config_for("Q8_0", 40, 512) != tk.heuristic_config("Q8_0", 40, 512):
    failures.append(("legacy default changed",))
# the dequantized copy for passes of many rows: bitwise the fp32 values of dequantize, rounded once to the dtype,
# and the op takes it from DEQUANT_MIN_ROWS rows on
for qtype in ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K_LANES"]:
    elems = 256 if qtype in tk.K_QUANTS else QUANT_FORMATS[qtype].block_elems
    n, k = 40, 2 * 256 if qtype in tk.K_QUANTS else 288  # a ragged N-tile; 288: a ragged K-tile of 32-blocks
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // elems, seed=4))
    w = dequantize(blocks, qtype)
    for dtype in (torch.float32, torch.bfloat16):
        got = tk.dequantize(blocks, qtype, k, dtype)
        if got.dtype != dtype or not torch.equal(got, w.to(dtype)):
            failures.append((qtype, dtype, "dequantize kernel differs from dequantize"))
    x = torch.randn(tk.DEQUANT_MIN_ROWS, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    if not torch.equal(gpu_kernels.KERNELS[qtype](x, blocks, n), torch.nn.functional.linear(x, w.bfloat16())):
        failures.append((qtype, "the op's many-row pass is not F.linear on the dequantized weight"))
# Q4_K blocks super-block-major in chunks of rows (quant.q4k_columns), read where they lie: dequantized, the same
# bits as their rows; the packed product (17 rows: two M-tiles; a K split; a ragged N-tile), the same bits as on the
# rows. Chunks of 8 rows, so one program's 32 or 64 rows span several. The op on a Q4_K_COLUMNS weight takes these
# reads for a short pass and a prefill's, never a copy back to GGUF's order.
rows = torch.from_numpy(random_blocks("Q4_K", rows=40, blocks_per_row=2, seed=6))
chunked = rows.reshape(5, 8, 2, 144).transpose(1, 2).contiguous().reshape(40, 2 * 144)
if not torch.equal(tk.dequantize(chunked, "Q4_K", 512, torch.bfloat16, chunk_rows=8),
                   dequantize(rows, "Q4_K").bfloat16()):
    failures.append(("dequantize of 8-row chunks differs from dequantize of the rows",))
x = torch.randn(17, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
for cfg in (tk.QuantConfig(32, 256, 2, 4, 3, packed=True), tk.QuantConfig(64, 512, 1, 4, 1, packed=True)):
    if not torch.equal(tk.launch(x, chunked, 40, "Q4_K", cfg, chunk_rows=8), tk.launch(x, rows, 40, "Q4_K", cfg)):
        failures.append(("the packed product on 8-row chunks differs from the product on the rows", cfg.name))
tk.CONFIGS[("Q4_K", 40, 512)] = tk.QuantConfig(64, 256, 1, 4, 1)  # a per-element tiling adopted for the shape
if not torch.equal(tk.launch(x, chunked, 40, "Q4_K", chunk_rows=8),
                   tk.launch(x, rows, 40, "Q4_K", tk.default_config("Q4_K", 40, 512))):
    failures.append(("chunks under an adopted per-element tiling: not the packed default's product",))
del tk.CONFIGS[("Q4_K", 40, 512)]
rows = torch.from_numpy(random_blocks("Q4_K", rows=q4k_columns.CHUNK_ROWS, blocks_per_row=2, seed=7))
w = dequantize(rows, "Q4_K").bfloat16()
x = torch.randn(tk.DEQUANT_MIN_ROWS, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
to_rows = q4k_columns.to_rows
q4k_columns.to_rows = lambda b: failures.append(("a pass copied the chunks back",)) or to_rows(b)
for m in (20, tk.DEQUANT_MIN_ROWS):
    got = gpu_kernels.KERNELS[q4k_columns.QTYPE](x[:m], q4k_columns.from_rows(rows), rows.shape[0])
    want = gpu_kernels.KERNELS["Q4_K"](x[:m], rows, rows.shape[0])
    if not torch.equal(got, want) or (m >= tk.DEQUANT_MIN_ROWS and not torch.equal(got, torch.nn.functional.linear(
            x[:m], w))):
        failures.append(("the op's pass of", m, "rows on Q4_K_COLUMNS is not its pass on the rows"))
q4k_columns.to_rows = to_rows
for bad, call in (("Q5_K in chunks", lambda: tk.dequantize(torch.zeros(16, 176, dtype=torch.uint8), "Q5_K", 256,
                                                            torch.bfloat16, 8)),
                  ("12 rows in chunks of 8", lambda: tk.launch(torch.zeros(1, 256), torch.zeros(12, 144,
                                                               dtype=torch.uint8), 12, "Q4_K", chunk_rows=8)),
                  ("chunks for the per-element decode", lambda: tk.launch(
                      torch.zeros(1, 256), torch.zeros(16, 144, dtype=torch.uint8), 16, "Q4_K",
                      tk.QuantConfig(32, 256), chunk_rows=8))):
    try:
        call()
        failures.append(("accepted " + bad,))
    except ValueError as e:
        if "chunks of 8 rows" not in str(e) and "chunks of rows are read by the packed decode only" not in str(e):
            failures.append(("the error for " + bad, str(e)))
try:
    tk.dequantize(torch.zeros(8, 100, dtype=torch.uint8), "Q4_K", 256, torch.bfloat16)
    failures.append(("dequantize accepted blocks of the wrong size",))
except ValueError as e:
    if "Q4_K blocks of 256 weights a row must be uint8 [N, 144]" not in str(e):
        failures.append(("dequantize's error", str(e)))
for qtype in tk.QTYPE_CODES:  # the kernels' row sizes are the modules' (quant.formats, above the kernels package)
    for k in (256, 512, 2048, 5376):
        if tk.row_bytes(qtype, k) != row_bytes(qtype, k):
            failures.append(("row_bytes", qtype, k, tk.row_bytes(qtype, k), row_bytes(qtype, k)))
rule = tk.dequantizes
if not (rule(tk.DEQUANT_MIN_ROWS, 4096, 4096, torch.bfloat16) and not rule(tk.DEQUANT_MIN_ROWS - 1, 4096, 4096,
        torch.bfloat16) and not rule(512, 262144, 5376, torch.bfloat16)):
    failures.append(("dequantizes: rows from DEQUANT_MIN_ROWS, copies of at most DEQUANT_MAX_BYTES",))
print("FAILURES", failures)
sys.exit(1 if failures else 0)
"""


@pytest.mark.skipif(not _has_triton(), reason="needs Triton (its interpreter on the CPU)")
def test_every_kernel_matches_dequantize_and_is_batch_invariant():
    """Every quant type, its per-element decode (and the packed one for the K-quants), with and without a K split,
    a ragged N edge, two M-tiles, and the dequantized copy that passes of many rows take, under the interpreter
    (in a fresh process: TRITON_INTERPRET must be set before Triton is first imported): fp32 activations give the
    product with the dequantized weights to fp32 accuracy; bf16 ones agree with a bf16 reference and are bitwise
    the same row by row for M = 1..17. The packed decode's weights are bitwise the dequantized ones, its x
    permutation is a permutation of range(K), and a strided x gives the same rows."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK, str(ROOT / "tests")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


ABLATE_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import kquant_ablate as ka
from flashdraft.quant import mma_kernels

text = mma_kernels.SOURCE.read_text()
for name in ka.VARIANTS:
    out = ka.variant_source(name, text)
    assert out != text, name
    for old, new, _ in ka.VARIANTS[name]:
        assert old not in out or old in new, (name, old)  # (a patch may keep the old text for other builds)
ahead = ka.variant_source("x a super-block ahead", text)
assert "x_of_super_block(xnext, xrow, xok, sb + 1);" in ahead and "xv[nt][h] = xcur[gq][nt][h];" in ahead
shared = ka.variant_source("x in shared memory", text)
assert "__syncthreads();" in shared and "xrow[nt] = x_shared + " in shared
assert "prefetch.global.L1" in ka.variant_source("x into L1 2 ahead", text)
ring = ka.variant_source("x in the copy engine's ring", text)
assert ring.count("bulk_copy(x_ring_addr + 512 * ") == 2 and '"r"(x_in_ring ? 2 : 1)' in ring
assert ka.SAME_BITS <= set(ka.VARIANTS) and ka.SAME_BITS <= ka.Q45_ONLY
arithmetic = ka.variant_source("all arithmetic", text)
assert all(new in arithmetic for part in ("x sums", "group scales", "super-block correction", "weight MMAs")
           for _, new, _ in ka.VARIANTS[part])
assert "gridDim.z == 1) return;" in ka.variant_source("launch only", text)
assert ka.variant_source("as is", text).replace(ka.HELPERS, "") == text
try:
    ka.variant_source("x sums", text.replace("mma_bf16_16816(ones,", "mma_bf16_16816(ones ,", 1))
    sys.exit("a patch that no longer fits the kernel was applied")
except ValueError as e:
    assert "occurs 0 times in the kernel, not 1" in str(e), e
print("OK")
"""


@pytest.mark.skipif(not _has_triton(), reason="the script imports the Triton kernels (run under the interpreter)")
def test_ablation_variants_fit_the_kernel():
    """scripts/gpu/kquant_ablate.py's text patches (each stage of the k-quant kernel left out) apply to
    kquant_mma.cu as written, exactly as often as listed, and a patch that no longer fits stops the script; an
    unknown shape set is refused by name before any GPU work."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", ABLATE_CHECK, str(ROOT / "scripts" / "gpu")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout[-3000:] + proc.stderr[-3000:]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "kquant_ablate.py"), "out",
                          "--only", "qwen-q6k,qwen-q6", "--budget-s", "1"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.environ.get("TMPDIR", "/tmp"))
    assert bad.returncode == 2 and "unknown shape sets ['qwen-q6']" in bad.stderr, bad.stderr[-3000:]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "kquant_ablate.py"), "out",
                          "--variants", "x sums,x early"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.environ.get("TMPDIR", "/tmp"))
    assert bad.returncode == 2 and "unknown variants ['x early']" in bad.stderr, bad.stderr[-3000:]


VARIANT_SOURCES = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import kquant_ablate as ka
from flashdraft.quant import mma_kernels
from flashdraft.quant.mma_kernels import MmaTiling

# a build of each kind the step runs: the copy engine's ring, the lanes' ring at 16 rows, direct loads, Q5_K, Q6_K
BUILDS = [("Q4_K_COLUMNS", MmaTiling(2, 4, 1, 2, 3, bulk=True), 1), ("Q4_K_COLUMNS", MmaTiling(1, 2, 1, 1, 6), 2),
          ("Q4_K", MmaTiling(1, 4, 6, 1), 1), ("Q5_K", MmaTiling(1, 2, 1, 1, 3), 1), ("Q6_K_LANES", MmaTiling(1, 2), 2)]
text = mma_kernels.SOURCE.read_text()
out = Path(sys.argv[2])
for v, name in enumerate(ka.VARIANTS):
    source = ka.variant_source(name, text)
    for b, (qtype, tiling, nt) in enumerate(BUILDS):
        (out / f"v{v}_b{b}.cu").write_text(mma_kernels.kernel_defines(tiling, nt, qtype) + source)
print(len(ka.VARIANTS) * len(BUILDS))
"""


@pytest.mark.skipif(not _has_triton() or shutil.which("nvcc") is None,
                    reason="needs nvcc, and the script imports the Triton kernels (run under the interpreter)")
def test_ablation_variants_compile_for_sm90(tmp_path):
    """Every variant of scripts/gpu/kquant_ablate.py compiles, for the H100/H200 (sm_90), in each kind of build
    Gemma's step runs (a patch may fit the text and still not compile: the GPU call would then stop at it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", VARIANT_SOURCES, str(ROOT / "scripts" / "gpu"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sources = sorted(tmp_path.glob("*.cu"))
    assert len(sources) == int(proc.stdout.split()[-1]) > 0

    def compile_one(cu: Path) -> tuple[Path, subprocess.CompletedProcess]:
        return cu, subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(cu.with_suffix(".cubin")), str(cu)],
                                  capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        failed = [(cu.name, done.stderr[-1500:]) for cu, done in pool.map(compile_one, sources) if done.returncode]
    assert not failed, failed


LAYOUT_CHECK = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
import q4k_layout_probe as lp
from flashdraft.quant import mma_kernels

text = mma_kernels.SOURCE.read_text()
for layout in ("lanes", "tiles"):
    out = lp.layout_source(layout, text)
    assert out != text, layout
assert lp.native_source("columns", 5376).startswith("#undef CHUNK_ROWS\n#define CHUNK_ROWS 5376\n")
assert lp.native_source("chunks", 5376).startswith("#undef CHUNK_ROWS\n#define CHUNK_ROWS 256\n")
assert "#define ROWB (RING_BULK ? BLOCK_BYTES : QTYPE == 4 ? 144 : 224)" in lp.layout_source("lanes", text)
assert "tile_base(" in lp.layout_source("tiles", text)
try:
    lp.layout_source("lanes", text.replace("#define ROWB", "#define ROW_BYTES", 1))
    sys.exit("a patch that no longer fits the kernel was applied")
except ValueError as e:
    assert "occurs 0 times in the kernel" in str(e), e
n, nsb = 512, 2
blocks = torch.randint(0, 256, (n, nsb * 144), dtype=torch.uint8)
out = lp.to_layout("tiles", lp.to_layout("lanes", blocks))
for r, sb, gq, c, b in ((0, 0, 0, 0, 0), (17, 1, 3, 2, 5), (31, 1, 1, 3, 7), (5, 0, 2, 1, 3)):
    tile_at = (r // 16) * 16 * nsb * 144 + sb * 16 * 144 + (r % 16) * 144  # tile-major
    src = blocks[r, sb * 144 + 16 + 32 * gq + 8 * c + b]
    assert out.reshape(-1)[tile_at + 16 + 32 * c + 8 * gq + b] == src, (r, sb, gq, c, b)  # lane order
    assert out.reshape(-1)[tile_at + 7] == blocks[r, sb * 144 + 7]  # the header stays
    at = 8 * c + b  # super-block-major
    assert lp.to_layout("columns", blocks).reshape(-1)[(sb * n + r) * 144 + at] == blocks[r, sb * 144 + at]
    r2 = r + 256  # the second chunk of 256 rows: its own super-block-major run after the first's
    at2 = (256 * nsb + sb * 256 + r) * 144 + at
    assert lp.to_layout("chunks", blocks).reshape(-1)[at2] == blocks[r2, sb * 144 + at]
print("OK")
"""


@pytest.mark.skipif(not _has_triton(), reason="the script imports the Triton kernels (run under the interpreter)")
def test_layout_probe_patches_fit_the_kernel():
    """scripts/gpu/q4k_layout_probe.py: each layout's patches (lane order, tile-major) apply to kquant_mma.cu as
    written, a patch that no longer fits stops the script, the layouts the kernel reads itself set its chunk of
    rows, and lane order, tile-major and super-block-major put each byte where their kernels read it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", LAYOUT_CHECK, str(ROOT / "scripts" / "gpu")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout[-3000:] + proc.stderr[-3000:]


PROFILE_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import gguf_profile as gp

spans = [(0.0, 5.0), (3.0, 8.0), (10.0, 12.0), (11.0, 11.5), (11.0, 14.0)]
assert gp.exclusive_us(spans) == [5.0, 3.0, 2.0, 0.0, 2.0], gp.exclusive_us(spans)
assert gp.busy_us(list(reversed(spans))) == 12.0
print("OK")
"""


@pytest.mark.skipif(not _has_triton(), reason="the scripts import the Triton kernels (run under the interpreter)")
def test_profile_scripts_count_an_overlap_once():
    """gguf_profile.py / dflash_profile.py's attribution: a kernel launched while the one before it runs (a
    programmatic launch waiting for it) owns only the time past that one's end, and the GPU's busy time counts an
    overlap once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", PROFILE_CHECK, str(ROOT / "scripts" / "gpu")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout[-3000:] + proc.stderr[-3000:]


def test_attention_run_refuses_an_unknown_cache_type_pair():
    """scripts/gpu/attention_run.py --cache-types: a pair that is not two known KV cache types is refused by name
    before any GPU work; so are --kv-lens that are not key counts of at least 22."""
    script = ROOT / "scripts" / "gpu" / "attention_run.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    for spec, message in (("q5_0", "'q5_0' is not K,V (two KV cache types"),
                          ("q5_0,q3_k", "unknown KV cache type 'q3_k'; supported: f32, f16, bf16, q8_0")):
        proc = subprocess.run([sys.executable, str(script), "out", "--cache-types", spec], env=env,
                              capture_output=True, text=True, timeout=120, cwd=os.environ.get("TMPDIR", "/tmp"))
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    for spec, message in (("64,x", "'64,x' is not N,N,... (key counts)"), ("16,512", "at least 22")):
        proc = subprocess.run([sys.executable, str(script), "out", "--kv-lens", spec], env=env,
                              capture_output=True, text=True, timeout=120, cwd=os.environ.get("TMPDIR", "/tmp"))
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
