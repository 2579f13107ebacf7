"""scripts/gpu/side_by_side.sh and its helper side_by_side_gguf.py on the CPU: argument checks, the table built from
llama-bench's JSON (a fixture of the 2026-12-01 H200 figures), the dry-run plan, and the whole script end to end on
make_gguf.py's tiny files with a stand-in llama-bench (a real one needs the GPU machine's build), resuming where an
earlier call stopped."""
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "side_by_side.sh"
HELPER = ROOT / "scripts" / "gpu" / "side_by_side_gguf.py"
BENCH = Path(os.environ.get("FLASHDRAFT_LLAMACPP_BENCH", ROOT.parent / "shared" / "llamacpp-bench"))


def load_helper():
    spec = importlib.util.spec_from_file_location("side_by_side_gguf", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sbs = load_helper()


def record(n_prompt, n_gen, depth, ts):
    """A llama-bench -o json record, with the fields the table reads and a few it does not."""
    return {"build_commit": "ba1fdce5", "gpu_info": "NVIDIA H200", "model_type": "gemma4 31B Q4_K - Small",
            "model_size": 17748647936, "n_gpu_layers": 99, "flash_attn": True, "n_prompt": n_prompt, "n_gen": n_gen,
            "n_depth": depth, "avg_ts": ts, "stddev_ts": 0.5, "samples_ts": [ts, ts]}


# The Gemma-4-31B Q4_K_S figures of ../shared/llamacpp-bench (2026-12-01), as the two runs side_by_side.sh makes
# write them: prefill lengths first, then decoding at three depths.
LLAMA_RUNS = [[record(512, 0, 0, 2381.16), record(8192, 0, 0, 2100.0)],
              [record(0, 128, 0, 75.72), record(0, 128, 8192, 68.06), record(0, 128, 32768, 65.93)]]
OURS = {"device": "NVIDIA H200", "tokens": 128, "depths": [0, 8192, 32768], "errors": [], "build_running": True,
        "plain": [{"depth": 0, "tok_s": 151.44}, {"depth": 512, "tok_s": 150.0}, {"depth": 8192, "tok_s": 102.09},
                  {"depth": 32768, "tok_s": 98.895}],
        "prefill": [{"prompt_n": 512, "tok_s": 2381.16}, {"prompt_n": 8192, "tok_s": 4200.0}],
        "dflash": [{"prompt_n": 512, "tau_planned": 6, "tau": 5.8, "tok_s": 605.76, "speedup": 4.0, "identical": True},
                   {"prompt_n": 512, "tau_planned": 8, "tau": 7.6, "tok_s": 700.0, "speedup": 4.6, "identical": False},
                   {"prompt_n": 32768, "tau_planned": 6, "tau": 5.8, "tok_s": 380.0, "speedup": 3.8,
                    "identical": True}]}


def test_llama_bench_json_runs_are_read_concatenated(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text("\n".join(json.dumps(run, indent=2) for run in LLAMA_RUNS) + "\n")
    records = sbs.llama_records(path)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in records] == [
        (512, 0, 0), (8192, 0, 0), (0, 128, 0), (0, 128, 8192), (0, 128, 32768)]
    assert sbs.llama_ts(records, 0, 128, 8192) == 68.06 and sbs.llama_ts(records, 0, 128, 4096) is None


def test_table_rows_pair_each_test_and_ratio(tmp_path):
    records = [r for run in LLAMA_RUNS for r in run]
    rows = {r["test"]: r for r in sbs.table_rows(records, OURS)}
    assert list(rows) == ["tg128", "tg128 @ d8192", "tg128 @ d32768", "pp512", "pp8192",
                          "DFlash tau 6 vs tg128", "DFlash tau 8 vs tg128",
                          "DFlash tau 6 vs tg128 @ d32768"]  # depth 512: DFlash's baseline only
    assert (rows["tg128"]["llama"], rows["tg128"]["ours"]) == (75.72, 151.44)
    assert (rows["tg128 @ d32768"]["llama"], rows["tg128 @ d32768"]["ours"]) == (65.93, 98.895)
    assert (rows["pp8192"]["llama"], rows["pp8192"]["ours"]) == (2100.0, 4200.0)
    assert rows["DFlash tau 6 vs tg128"]["llama"] == 75.72 and "tau 5.80, 4.00x own plain" in rows[
        "DFlash tau 6 vs tg128"]["note"]
    assert "TOKENS DIFFER" in rows["DFlash tau 8 vs tg128"]["note"]
    long = rows["DFlash tau 6 vs tg128 @ d32768"]  # after a 32K prompt: against llama.cpp's plain decoding at 32K
    assert long["llama"] == 65.93 and long["note"].startswith("after 32768 tokens, tau 5.80, 3.80x own plain")
    assert "drafter window" not in long["note"]
    windowed = {r["test"]: r for r in sbs.table_rows(records, {**OURS, "draft_window": 1024})}
    assert windowed["DFlash tau 6 vs tg128 @ d32768"]["note"].endswith(", drafter window 1024")

    res = tmp_path / "results"
    res.mkdir()
    (res / "llama-gemma-4-31b__q4_k_s.json").write_text("".join(json.dumps(r) for r in LLAMA_RUNS))
    (res / "flashdraft-gemma-4-31b__q4_k_s.json").write_text(json.dumps(OURS))
    (res / "llama-qwen3-8b__q4_k_m.json").write_text(json.dumps([record(0, 128, 0, 206.2)]))  # one side only
    md, merged = tmp_path / "t.md", tmp_path / "r.json"
    assert sbs.main(["table", str(res), "--md", str(md), "--json", str(merged)]) == 0
    lines = md.read_text().splitlines()
    assert "| gemma-4-31b__q4_k_s | tg128 | 75.7 | 151.4 | 2.00x |  |" in lines
    assert "| gemma-4-31b__q4_k_s | tg128 @ d32768 | 65.9 | 98.9 | 1.50x |  |" in lines
    assert "| gemma-4-31b__q4_k_s | pp512 | 2381.2 | 2381.2 | 1.00x |  |" in lines
    assert any(line.startswith("| gemma-4-31b__q4_k_s | DFlash tau 6 vs tg128 | 75.7 | 605.8 | 8.00x |")
               for line in lines)
    assert "| qwen3-8b__q4_k_m | tg128 | 206.2 | - | - |  |" in lines
    assert any("while llama.cpp was being built" in line for line in lines)
    assert set(json.loads(merged.read_text())) == {"gemma-4-31b__q4_k_s", "qwen3-8b__q4_k_m"}
    assert sbs.main(["table", str(tmp_path / "empty")]) == 1


def test_plain_rows_are_set_against_their_roofline():
    """A plain row's note: its tok/s over the roofline of the bytes a step reads (the weights, and the cache at that
    depth) at the copy bandwidth measured in the same run; no note without all three figures."""
    plain = [{"depth": 0, "tok_s": 160.0, "kv_read_gb": 0.0}, {"depth": 32768, "tok_s": 100.0, "kv_read_gb": 4.0}]
    ours = {**OURS, "plain": plain, "weights_read_gb": 16.0, "copy_gb_s": 4000.0}
    rows = {r["test"]: r for r in sbs.table_rows([], ours)}
    assert rows["tg128"]["note"] == ("64% of the roofline (250.0 tok/s: 16.00 GB weights + 0.00 GB cache a token "
                                     "at 4000 GB/s)")
    assert rows["tg128 @ d32768"]["note"].startswith("50% of the roofline (200.0 tok/s: 16.00 GB weights + 4.00 GB")
    assert rows["tg128 @ d8192"]["note"] == ""  # no plain row at that depth
    for missing in ("copy_gb_s", "weights_read_gb"):  # e.g. a CPU run: no bandwidth
        assert {r["note"] for r in sbs.table_rows([], {k: v for k, v in ours.items() if k != missing})
                if r["test"].startswith("tg")} == {""}


def test_the_bytes_a_step_reads(tmp_path):
    """weights_read_gb: every tensor of the file, but the token embedding where the file has an LM head of its own;
    kv_read_gb: each layer's rows up to kv_len at their stored size, a sliding layer's at most its ring."""
    import numpy as np
    import torch

    from flashdraft.config import ModelConfig
    from flashdraft.models.gemma4.config import FULL, SLIDING, Gemma4Config, RopeSpec
    from flashdraft.models.gemma4.model import Gemma4Cache
    from flashdraft.models.kv_cache import KVCache

    def write(path, names):
        w = gguf.GGUFWriter(str(path), "llama")
        for i, name in enumerate(names):
            w.add_tensor(name, np.full((4, 8 * (i + 1)), i, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    own_head = write(tmp_path / "a.gguf", ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"])
    assert sbs.weights_read_gb(own_head) == (4 * 16 + 4 * 24) * 4 / 1e9
    tied = write(tmp_path / "b.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    assert sbs.weights_read_gb(tied) == (4 * 8 + 4 * 16) * 4 / 1e9

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cache = KVCache(cfg, 100, torch.device("cpu"), torch.bfloat16)
    assert sbs.kv_read_gb(cache, 40) == 3 * 2 * 40 * 2 * 32 * 2 / 1e9  # layers, k and v, rows, heads, dims, bytes
    assert sbs.kv_read_gb(cache, 500) == sbs.kv_read_gb(cache, 100)
    packed = KVCache(cfg, 100, torch.device("cpu"), torch.bfloat16, "q8_0", "q4_0")  # 34 and 18 bytes a block
    assert sbs.kv_read_gb(packed, 40) == 3 * 40 * 2 * (34 + 18) / 1e9
    rope = {SLIDING: RopeSpec("default", 1e4), FULL: RopeSpec("default", 1e6)}
    gemma = Gemma4Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, layer_types=[SLIDING, FULL], layer_kv_heads=[2, 1],
                         layer_head_dims=[32, 64], sliding_window=8, rope=rope)
    ring = Gemma4Cache(gemma, 200, torch.device("cpu"), torch.bfloat16)
    assert ring.k[0].shape[1] < 100  # the sliding layer's ring
    assert sbs.kv_read_gb(ring, 100) == (ring.k[0].shape[1] * 2 * 32 + 100 * 1 * 64) * 2 * 2 / 1e9


def test_measure_arguments_are_checked(tmp_path, capsys):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    cases = {"--taus must be at least 2": ["--taus", "1,4"], "--tokens must be at least 2": ["--tokens", "1"],
             "no such GGUF file": [], "negative value": ["--depths", "0,-5"], "invalid choice": ["--drafter", "Q2_K"],
             "--draft-window must be at least 0": ["--draft-window", "-1"],
             "is not K,V": ["--cache-types", "q5_0"], "unknown KV cache type 'q3_k'": ["--cache-types", "q5_0,q3_k"]}
    for message, extra in cases.items():
        file = tmp_path / "missing.gguf" if message == "no such GGUF file" else gguf_file
        with pytest.raises(SystemExit) as e:
            sbs.main(["measure", str(file), str(tmp_path / "o.json"), *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err, message


@pytest.mark.parametrize("qtype", ["Q5_K", "bf16"])
def test_random_drafter_for_a_qwen3_target(tmp_path, qtype):
    """Llama/Qwen3 targets get a Qwen3-style drafter of their own shape whose projections hold qtype blocks (the
    Gemma 4 drafter is built in the end-to-end run below), with the target's LayerPlan (the engine refuses a pair
    built with two, as on the GPU, whose plan is not the default); it drafts losslessly with the oracle's guesses."""
    import torch

    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine
    from flashdraft.layers.plan import LayerPlan
    from flashdraft.models import load_target
    from flashdraft.quant import QuantLinear
    from tiny_models import build_target

    plan = LayerPlan(fuse_projections=True)
    target = load_target(build_target(tmp_path / "t", hidden=256), 256, torch.device("cpu"), torch.float32, plan)
    gen = torch.Generator().manual_seed(0)
    drafter = sbs.build_drafter(target, 256, qtype, True, torch.device("cpu"), torch.float32, gen)
    assert drafter.plan == target.plan == plan
    cfg = drafter.config
    assert (cfg.block_size, cfg.layers.num_hidden_layers, cfg.layers.hidden_size) == (8, 2, target.config.hidden_size)
    assert cfg.target_layer_ids and max(cfg.target_layer_ids) < target.config.num_hidden_layers
    quant = [m.qtype for m in drafter.modules() if isinstance(m, QuantLinear)]
    assert quant == ([] if qtype == "bf16" else [qtype] * len(quant)) and (qtype == "bf16" or quant)
    prompt = list(range(5, 29))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = Engine(target, None, None, context_size=256).generate(prompt, params, 0)
    assert Engine(target, None, drafter, context_size=256).generate(prompt, params, 7).tokens == plain.tokens


def fake_bench(folder: Path, make_gguf: Path | None = None) -> Path:
    """A bench folder: make_gguf.py (the real one, or an empty stand-in), gguf-py in the tarball (the installed
    gguf package), and a device_cmd.sh that 'builds' a stand-in llama-bench printing records for its -p/-n/-d."""
    folder.mkdir(parents=True, exist_ok=True)
    if make_gguf is not None:
        shutil.copy(make_gguf, folder / "make_gguf.py")
    else:
        (folder / "make_gguf.py").write_text("")
    with tarfile.open(folder / "beellama-src.tar.gz", "w:gz") as tf:
        tf.add(Path(gguf.__file__).parent, arcname="beellama/gguf-py/gguf")
    (folder / "llama-bench.py").write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
def arg(flag, default):
    return [int(v) for v in a[a.index(flag) + 1].split(",")] if flag in a else default
recs = [dict(gpu_info="stand-in", n_prompt=p, n_gen=0, n_depth=d, avg_ts=1000.0 + p, stddev_ts=0.0)
        for d in arg("-d", [0]) for p in arg("-p", [512]) if p]
recs += [dict(gpu_info="stand-in", n_prompt=0, n_gen=n, n_depth=d, avg_ts=100.0 - d / 1000, stddev_ts=0.0)
         for d in arg("-d", [0]) for n in arg("-n", [128]) if n]
print(json.dumps(recs, indent=2))
""")
    (folder / "device_cmd.sh").write_text("""#!/usr/bin/env bash
set -e
mkdir -p "$BEE_WORK/build-test/bin" "$OUT"
echo "stand-in device_cmd.sh: built" | tee "$OUT/build.log"
install -m 755 "$(dirname "$0")/llama-bench.py" "$BEE_WORK/build-test/bin/llama-bench"
""")
    for name in ("device_cmd.sh", "llama-bench.py"):
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return folder


def run_script(args, env_extra, timeout=600):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_script_arguments_are_checked(tmp_path):
    bench = fake_bench(tmp_path / "bench")
    env = {"SBS_BENCH": str(bench), "SBS_WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "out")}
    cases = {"unknown phase or option 'bogus'": (["bogus"], {}),
             "SBS_MODELS: 'qwen3-8b:q8_0' is not SHAPE:TYPE": ([], {"SBS_MODELS": "qwen3-8b:q8_0"}),
             "SBS_DEPTHS must be comma-separated numbers": ([], {"SBS_DEPTHS": "0,8K"}),
             "SBS_DRAFTER must be": ([], {"SBS_DRAFTER": "Q2_K"}),
             "SBS_DRAFT_WINDOW must be a whole number": ([], {"SBS_DRAFT_WINDOW": "-1"}),
             "SBS_CACHE_TYPES must be K,V of f16": ([], {"SBS_CACHE_TYPES": "q5_0"}),
             "got 'q5_0,q3_k'": ([], {"SBS_CACHE_TYPES": "q5_0,q3_k"}),
             "BUDGET must be a whole number": ([], {"SBS_BUDGET_S": "ten"}),
             "must hold make_gguf.py": ([], {"SBS_BENCH": str(tmp_path / "nowhere")})}
    for message, (args, extra) in cases.items():
        proc = run_script(["--dry-run", *args], {**env, **extra})
        assert proc.returncode == 2 and message in proc.stderr, (message, proc.stderr)
    assert not (tmp_path / "out").exists()
    proc = run_script(["--help"], env)
    assert proc.returncode == 0 and "PHASE: build | files | flashdraft | llama | table" in proc.stdout


def test_the_gguf_py_folder_is_printed_for_other_scripts(tmp_path):
    """ab_run.sh reads the gguf-py folder from here: printed alone, extracted from the bench folder's tarball."""
    bench = fake_bench(tmp_path / "bench")
    env = {"SBS_BENCH": str(bench), "SBS_WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "out")}
    for _ in range(2):  # extracted, then found
        proc = run_script(["--print-gguf-py"], env)
        assert proc.returncode == 0, proc.stderr
        assert (Path(proc.stdout.strip()) / "gguf" / "__init__.py").is_file() and len(proc.stdout.splitlines()) == 1
    proc = run_script(["--print-gguf-py"], {**env, "SBS_BENCH": str(tmp_path / "nowhere")})
    assert proc.returncode == 2 and "must hold beellama-src.tar.gz" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_plan(tmp_path):
    bench = fake_bench(tmp_path / "bench")
    env = {"SBS_BENCH": str(bench), "SBS_WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "out"),
           "SBS_GGUF_DIR": str(tmp_path / "g")}
    proc = run_script(["--dry-run"], env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for model, drafter in (("gemma-4-31b__q4_k_s", "Q5_K"), ("qwen3-8b__q4_k_m", "Q5_K"), ("qwen3-8b__bf16", "bf16")):
        f = tmp_path / "g" / f"{model}.gguf"
        assert f"-o {f} --gguf-py" in out
        assert (f"side_by_side_gguf.py measure {f} {tmp_path / 'w' / 'results'}/flashdraft-{model}.json.part "
                f"--depths 0,8192,32768 --prefill 512,8192 --taus 4,6,8 --dflash-prompt 512 --tokens 128 --reps 1 "
                f"--drafter {drafter}"
                in out)
        assert f"llama-bench -m {f} -p 512,8192 -n 0 -ngl 99 -fa 1 -r 3 -o json -oe md" in out
        assert f"llama-bench -m {f} -p 0 -n 128 -d 0,8192,32768 -ngl 99 -fa 1 -r 3 -o json -oe md" in out
    order = [out.index(s) for s in ("BEE_BUDGET_S=60", "BEE_BUDGET_S=5", "make_gguf.py",
                                    "side_by_side_gguf.py measure", "llama-bench -m")]
    assert order == sorted(order), "by default: build start, build wait, files, flashdraft, llama.cpp"
    out = run_script(["--dry-run"], {**env, "SBS_SERIAL": "0"}).stdout
    order = [out.index(s) for s in ("BEE_BUDGET_S=60", "make_gguf.py", "side_by_side_gguf.py measure",
                                    "BEE_BUDGET_S=5", "llama-bench -m")]
    assert order == sorted(order), "SBS_SERIAL=0: build start, files, flashdraft during the build, build wait, llama"
    out = run_script(["--dry-run", "flashdraft"], {**env, "SBS_DRAFT_WINDOW": "1024"}).stdout
    assert out.count("--drafter Q5_K --draft-window 1024") == 2 and "--drafter bf16 --draft-window 1024" in out
    # the walkthrough's KV cache types, on both sides
    out = run_script(["--dry-run", "flashdraft", "llama"], {**env, "SBS_CACHE_TYPES": "q5_0,q4_1"}).stdout
    assert out.count("--drafter Q5_K --cache-types q5_0,q4_1") == 2
    assert out.count("-ngl 99 -fa 1 -ctk q5_0 -ctv q4_1 -r 3 -o json") == 6
    # one phase: llama.cpp only (a missing file is written first), no build
    proc = run_script(["--dry-run", "llama"], {**env, "SBS_MODELS": "qwen3-8b:bf16", "SBS_REPS": "5"})
    assert "BEE_BUDGET_S" not in proc.stdout and "side_by_side_gguf.py measure" not in proc.stdout
    assert proc.stdout.index("make_gguf.py --shape qwen3-8b --type bf16") < proc.stdout.index("-r 5 -o json")
    assert not list((tmp_path / "w" / "results").iterdir()) and not (tmp_path / "out").exists()


@pytest.mark.skipif(not (BENCH / "make_gguf.py").is_file(), reason=f"{BENCH / 'make_gguf.py'} not found")
def test_whole_script_on_tiny_files_and_a_stand_in_llama_bench(tmp_path):
    bench = fake_bench(tmp_path / "bench", BENCH / "make_gguf.py")
    out, work, files = tmp_path / "out", tmp_path / "w", tmp_path / "g"
    env = {"SBS_BENCH": str(bench), "SBS_WORK": str(work), "OUT": str(out), "SBS_GGUF_DIR": str(files),
           "SBS_MODELS": "tiny-gemma4:q4_k_s", "SBS_DEPTHS": "0,64", "SBS_PREFILL": "32,64",
           "SBS_TAUS": "4", "SBS_TOKENS": "8", "SBS_REPS": "1", "SBS_DFLASH_PROMPT": "24,64"}
    # too little time for a file: the call stops and asks to be called again
    proc = run_script(["files"], {**env, "SBS_BUDGET_S": "30"})
    assert proc.returncode == 3 and "call again" in proc.stdout, proc.stdout + proc.stderr

    proc = run_script([], {**env, "SBS_SERIAL": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "table.md").read_text()
    for model in ("tiny-gemma4__q4_k_s",):
        assert f"| {model} | tg8 | 100.0 |" in table and f"| {model} | tg8 @ d64 | 99.9 |" in table
        assert f"| {model} | pp64 | 1064.0 |" in table and f"| {model} | DFlash tau 4 vs tg8 | 100.0 |" in table
        ours = json.loads((out / "results.json").read_text())[model]["flashdraft"]
        assert ours["errors"] == [] and not ours["build_running"]
        assert [d["depth"] for d in ours["plain"]] == [0, 64]
        # each test in a cache of its own size (prompt + tokens + 64 rows), as llama-bench sizes its contexts
        assert [d["context"] for d in ours["plain"]] == [16 + 8 + 64, 64 + 8 + 64] and ours["context"] == 136
        # DFlash's base: plain decoding by the drafting engine after each prompt, whose tokens it must give
        assert [b["prompt_n"] for b in ours["dflash_baselines"]] == [24, 64]
        assert [b["context"] for b in ours["dflash_baselines"]] == [24 + 8 + 64, 64 + 8 + 64]
        assert [d["prompt_n"] for d in ours["dflash"]] == [24, 64]  # DFlash after each prompt length
        assert all(d["identical"] and d["tau"] > 1 for d in ours["dflash"])
        assert "warm_up_s" in ours  # warmed up as the server's slots are
        # the roofline's bytes (the copy bandwidth only on a GPU), the deeper test's cache the larger
        assert ours["weights_read_gb"] > 0 and "copy_gb_s" not in ours
        assert 0 < ours["plain"][0]["kv_read_gb"] < ours["plain"][1]["kv_read_gb"]
        assert not (files / f"{model}.gguf").exists()  # measured by both sides: deleted
    assert "TOKENS DIFFER" not in table
    assert {p.name for p in out.iterdir()} == {"table.md", "results.json", "side_by_side.log", "build.log"}

    # a later call finds everything measured
    proc = run_script([], env)
    assert proc.returncode == 0 and proc.stdout.count("measured in an earlier call") == 2, proc.stdout
