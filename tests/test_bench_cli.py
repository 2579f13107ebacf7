"""`flashdraft bench` in process on the tiny checkpoints: the --json schema, --plot, errors, the synthetic hook."""
import json
import sys
import types

import pytest
import torch

from flashdraft.bench.cli import main

ROW_KEYS = {"name", "baseline_tok_s", "dflash_tok_s", "speedup", "tau", "acceptance_rate", "identical",
            "draft_n", "draft_n_accepted", "mean_draft_length", "draft_lengths", "prompt_tokens",
            "baseline_tokens", "dflash_tokens", "baseline_gen_s", "dflash_gen_s", "reps", "baseline_spread",
            "dflash_spread", "noisy", "empty", "baseline_ttft_ms", "dflash_ttft_ms", "cache_n"}
SUMMARY_KEYS = (ROW_KEYS - {"name", "prompt_tokens", "empty"}
                | {"prompts", "noisy_prompts", "excluded_prompts"})


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny models run fastest on one thread, and far faster when other processes share the two cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"name": "raw", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"name": "talk", "turns": ["Hello", "And then?"]}) + "\n")
    return path


def bench_json(capsys, argv):
    code = main(argv + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err  # json.loads rejects anything but exactly one JSON value


def test_json_schema_greedy(capsys, qwen3_dir, drafter_dir, prompt_file):
    report, err = bench_json(capsys, ["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "--device",
                                      "cpu", "-n", "6", "--reps", "2", "--prompts", str(prompt_file)])
    assert set(report) == {"prompts", "summary", "config"}
    rows = report["prompts"]
    assert [r["name"] for r in rows] == ["raw", "talk-1", "talk-2"]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["identical"] is True                 # lossless: greedy DFlash equals plain decoding
        assert row["baseline_tok_s"] > 0 and row["dflash_tok_s"] > 0
        assert row["speedup"] == pytest.approx(row["dflash_tok_s"] / row["baseline_tok_s"])
        assert row["tau"] >= 1.0
        # The default (adaptive) policy may stop drafting for this random drafter, so no draft count is required.
        assert row["acceptance_rate"] is None or 0 <= row["acceptance_rate"] <= 1
        assert sum(row["draft_lengths"].values()) > 0 and all(0 <= int(k) <= 7 for k in row["draft_lengths"])
    # The second turn carries the first turn and the model's reply, so its prompt is longer.
    assert rows[2]["prompt_tokens"] > rows[1]["prompt_tokens"]
    s = report["summary"]
    assert set(s) == SUMMARY_KEYS and s["prompts"] == 3 and s["identical"] is True
    assert s["draft_n"] == sum(r["draft_n"] for r in rows)
    assert s["reps"] == 2 and all(r["reps"] == 2 and r["empty"] is False for r in rows)
    c = report["config"]
    assert c["mode"] == "in-process" and c["reps"] == 2 and c["n_predict"] == 6 and isinstance(c["seed"], int)
    assert c["draft"] == "default" and set(c["draft_cost"]) == {"fixed", "per_token"} and c["threads"] == 1
    assert "raw" in err and "all (3)" in err  # the table went to stderr


def test_sampling_reports_null_identical_and_plot_writes_png(capsys, qwen3_dir, drafter_dir, tmp_path):
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"name": "chat", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    png = tmp_path / "bench.png"
    report, err = bench_json(capsys, ["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "--device",
                                      "cpu", "-n", "5", "--temp", "0.9", "--seed", "7", "--prompts", str(prompts),
                                      "--plot", str(png), "--draft-n", "3"])
    assert report["prompts"][0]["identical"] is None and report["summary"]["identical"] is None
    assert report["config"]["seed"] == 7 and report["config"]["draft"] == 3
    assert set(report["prompts"][0]["draft_lengths"]) <= {"0", "1", "2", "3"}
    assert report["prompts"][0]["draft_n"] > 0  # a fixed length drafts on every step
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in err


def test_table_goes_to_stdout_without_json(capsys, qwen3_dir, drafter_dir, prompt_file):
    prompts = prompt_file.parent / "raw.jsonl"
    prompts.write_text(prompt_file.read_text().splitlines()[0] + "\n")
    assert main(["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "--device", "cpu", "-n", "3",
                 "--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("prompt") and out[2].startswith("raw") and out[4].startswith("all (1)")
    assert all(line.startswith("warning: repetitions disagree") for line in out[5:])  # 3 tokens: noisy


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps must be >= 1"),
    (["--baseline-url", "http://127.0.0.1:1"], "--baseline-url needs --url"),
    (["--url", "http://127.0.0.1:1", "-m", "x"], "-m apply to in-process runs"),
    (["--url", "ftp://host"], "must start with http:// or https://"),
    (["--prompts", "nonsense"], "neither a built-in set"),
    (["-m", "/nonexistent/model"], "/nonexistent/model"),
    (["--temp", "-1"], "temperature must be >= 0"),
    (["-t", "0"], "-t/--threads must be >= 1"),
    (["--draft-n", "0"], "--draft-n must be >= 1"),
    (["--draft-n", "3", "--no-adaptive"], "pass one of them"),
    (["--url", "http://127.0.0.1:1", "--no-adaptive"], "--no-adaptive apply to in-process runs"),
    (["--plot", "/nonexistent/dir/x.png"], "--plot: folder"),
    (["--context", "-5"], "--context must be >= 0"),
    (["--url", "http://127.0.0.1:1", "--context", "100"], "--context apply to in-process runs"),
])
def test_bad_arguments_are_clean_errors(capsys, argv, message):
    assert main(argv) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("flashdraft bench: error: ") and message in last


def test_context_runs_the_prompts_at_depth(capsys, qwen3_dir, drafter_dir, prompt_file):
    """--context N puts N tokens of the package's own source before every prompt: each row's prompt is N tokens
    longer than without, greedy DFlash still equals plain decoding, and the config records N."""
    argv = ["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "512", "--device", "cpu", "-n", "4", "--reps", "1",
            "--prompts", str(prompt_file)]
    plain, _ = bench_json(capsys, argv)
    deep, _ = bench_json(capsys, argv + ["--context", "300"])
    assert deep["config"]["context"] == 300 and plain["config"]["context"] == 0
    assert [r["prompt_tokens"] - 300 for r in deep["prompts"][:2]] == [r["prompt_tokens"] for r in plain["prompts"][:2]]
    assert all(r["identical"] for r in deep["prompts"])
    assert main(argv + ["--context", "600"]) == 1  # past -c 512: the error names the prompt and the context
    assert "512" in capsys.readouterr().err


def test_no_adaptive_drafts_the_full_block_every_step(capsys, qwen3_dir, drafter_dir, prompt_file):
    """`bench --no-adaptive` (the README's): DFlash drafts the full block on every step but a request's last ones."""
    report, _ = bench_json(capsys, ["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "--device", "cpu",
                                    "-n", "12", "--reps", "1", "--prompts", str(prompt_file), "--no-adaptive"])
    assert report["config"]["draft"] == "full" and "draft_cost" not in report["config"]
    for row in report["prompts"]:
        lengths = {int(k): v for k, v in row["draft_lengths"].items()}
        # block 8: seven guesses a step, fewer only where fewer tokens are left (one step each)
        assert lengths[7] >= 2 and all(steps == 1 for n, steps in lengths.items() if n < 7)
        assert row["identical"] is True


def test_empty_rows_are_flagged_in_process(capsys, qwen3_dir, drafter_dir, tmp_path, monkeypatch):
    """A prompt whose first generated token is EOS: its row says so and the summary leaves it out."""
    from flashdraft.engine.generator import Engine

    prompts = tmp_path / "two.jsonl"
    prompts.write_text(json.dumps({"name": "ends", "prompt": "def add(a, b):"}) + "\n"
                       + json.dumps({"name": "goes", "prompt": "class Stack:"}) + "\n")
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    first = engine.generate(engine.encode_prompt("def add(a, b):"),
                            __import__("flashdraft.config", fromlist=["SamplingParams"]).SamplingParams(max_tokens=1),
                            draft=0).tokens[0]
    second = engine.generate(engine.encode_prompt("class Stack:"),
                             __import__("flashdraft.config", fromlist=["SamplingParams"]).SamplingParams(max_tokens=1),
                             draft=0).tokens[0]
    if first == second:
        pytest.skip("both prompts start with the same token")
    load = Engine.load

    def load_with_eos(*args, **kwargs):
        e = load(*args, **kwargs)
        e.eos_ids = {first}  # the first prompt's first token ends the reply at once
        return e

    monkeypatch.setattr(Engine, "load", staticmethod(load_with_eos))
    report, err = bench_json(capsys, ["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "--device", "cpu",
                                      "-n", "8", "--reps", "1", "--prompts", str(prompts)])
    rows = {r["name"]: r for r in report["prompts"]}
    assert rows["ends"]["empty"] is True and rows["ends"]["dflash_tokens"] == 0
    assert rows["goes"]["empty"] is False
    s = report["summary"]
    assert s["prompts"] == 1 and s["excluded_prompts"] == ["ends"]
    assert s["dflash_tok_s"] == rows["goes"]["dflash_tok_s"]
    assert "no tokens: excluded" in err and "all (1 of 2)" in err and "note: no tokens generated" in err


def test_model_without_drafter_and_draft_n_out_of_range(capsys, qwen3_dir, drafter_dir):
    assert main(["-m", str(qwen3_dir), "--device", "cpu"]) == 1
    assert "pass a drafter with -md" in capsys.readouterr().err
    assert main(["-m", str(qwen3_dir), "-md", str(drafter_dir), "--device", "cpu", "--draft-n", "8"]) == 1
    assert "--draft-n must be between 1 and 7" in capsys.readouterr().err


def test_no_arguments_without_the_demo_pair_is_a_clean_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("flashdraft.demo.DEMO_DIR", tmp_path)
    assert main([]) == 1
    err = capsys.readouterr().err
    assert "embedded demo model is missing" in err and "Traceback" not in err


def test_synthetic_hook(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashdraft.bench.synthetic", None)  # as if the module were not installed
    assert main(["--synthetic", "gemma4-31b"]) == 1
    assert "synthetic mode is not available" in capsys.readouterr().err

    seen = []
    fake = types.ModuleType("flashdraft.bench.synthetic")
    fake.main = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "flashdraft.bench.synthetic", fake)
    assert main(["--synthetic", "gemma4-31b", "-n", "64"]) == 0
    assert seen[0].synthetic == "gemma4-31b" and seen[0].n_predict == 64
    for flags in (["-m", "x"], ["--prompts", "agent"], ["--draft-n", "3"], ["--url", "http://h"]):
        assert main(["--synthetic", "gemma4-31b", *flags]) == 1
        assert f"--synthetic does not take {flags[0]}" in capsys.readouterr().err


def test_synthetic_runs_the_sampling_flags(capsys):
    """--temp/--top-k/--seed reach both ways of the synthetic benchmark (they were ignored): sampled DFlash gives
    the sampled baseline's tokens at every planned tau."""
    assert main(["--synthetic", "tiny", "-n", "24", "--temp", "0.7", "--top-k", "20", "--seed", "3", "--json",
                 "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "min_p": 0.0, "seed": 3}
    assert report["dflash"] and all(row["identical"] for row in report["dflash"])
    assert report["dflash"][-1]["tau"] > 3


def test_repetitions_of_a_prompt_start_from_the_same_policy_state(qwen3_dir, drafter_dir):
    """Each repetition of a prompt starts from the policy as the prompt found it, so greedy repetitions make the
    same draft decisions (their spread is the machine's noise); the next prompt goes on from the last one."""
    from flashdraft.bench.prompts import BenchPrompt
    from flashdraft.bench.runner import InProcessBackend, run_bench
    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import AdaptiveDraft, Engine

    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    backend = InProcessBackend(engine, SamplingParams(max_tokens=40, ignore_eos=True),
                               AdaptiveDraft(engine.max_draft, cost=None))
    prompts = [BenchPrompt("a", prompt="def add(a, b):"), BenchPrompt("b", prompt="class Stack:")]
    results = run_bench(backend, prompts, reps=3)
    for result in results:
        lengths = [m.draft_lengths for m in result.dflash]
        assert lengths[0] == lengths[1] == lengths[2]
        assert len({m.steps for m in result.dflash}) == 1
    # The policy learnt across prompts, one repetition's worth each (the last one's state), and not from the
    # warm-up, which drafts with a throwaway copy (the first prompt meets a fresh policy).
    assert backend.dflash_draft.steps == results[0].dflash[0].steps + results[1].dflash[0].steps
