"""`flashdraft generate`, stop rules, streaming, and clear errors for bad input."""
import json
import os
import subprocess
import sys

import pytest

from flashdraft.cli import main
from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Delta, GenerationResult


def test_generate_json(qwen3_dir, drafter_dir, capsys):
    rc = main(["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "-p", "def add(a, b):", "-n", "20",
               "--json", "--device", "cpu", "-c", "128"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_n"] == len(out["tokens"]) <= 20
    for key in ("text", "prompt_n", "prompt_ms", "predicted_ms", "predicted_per_second", "draft_n",
                "draft_n_accepted", "steps", "tau", "accepted_per_position"):
        assert key in out
    rc = main(["generate", "-m", str(qwen3_dir), "-p", "def add(a, b):", "-n", "20", "--json", "--device", "cpu",
               "-c", "128"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["tokens"] == out["tokens"] and plain["draft_n"] == 0


def test_generate_text_and_summary(qwen3_dir, drafter_dir, capsys):
    rc = main(["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "-p", "hello", "-n", "12", "--chat",
               "--device", "cpu", "-c", "128"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tok/s" in err and "tau" in err and "acceptance" in err


@pytest.mark.parametrize("args,message", [
    (["-p", ""], "prompt is empty"),
    (["-p", "x " * 200, "-c", "64"], "does not fit the context size 64"),
    (["-p", "x", "--temp", "-1"], "temperature must be >= 0"),
    (["-p", "x", "--top-p", "0"], "top_p must be in"),
    (["-p", "x", "-n", "0"], "max_tokens must be >= 1"),
    (["-p", "x", "--draft-n", "99"], "--draft-n must be between 0 and 7"),
])
def test_generate_errors(qwen3_dir, drafter_dir, capsys, args, message):
    base = ["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "--device", "cpu"]
    if "-c" not in args:
        base += ["-c", "128"]
    assert main(base + args) == 1
    assert message in capsys.readouterr().err


def test_missing_model_folder_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashdraft.cli", "generate", "-m", str(tmp_path / "none"),
                           "-p", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "model folder not found" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_command():
    assert main(["frobnicate"]) == 2


def test_allocator_settings_unless_the_user_gives_some(tmp_path, monkeypatch):
    """Every command runs with expandable segments in CUDA's caching allocator (the 24 GB fit needs them), and a
    user's own PYTORCH_CUDA_ALLOC_CONF is left as it is."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["generate", "-m", str(tmp_path / "none"), "-p", "hi"]) != 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert main(["generate", "-m", str(tmp_path / "none"), "-p", "hi"]) != 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"


def test_stop_string_never_emitted(engine):
    prompt = engine.encode_prompt("def add(a, b):")
    full = engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), draft=0)
    assert len(full.text) > 6
    stop = full.text[3:6]
    for draft in (0, None):
        events = list(engine.stream(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]), draft))
        result = events[-1]
        assert isinstance(result, GenerationResult)
        streamed = "".join(e.text for e in events if isinstance(e, Delta))
        assert stop not in streamed and streamed == result.text == full.text[:full.text.index(stop)]
        assert result.finish_reason == "stop" and result.stop_type == "word" and result.stopping_word == stop
        # Tokens are those wholly before the stop string (text is cut exactly at the stop string).
        assert result.text.startswith(engine.tokenizer.decode(result.tokens).rstrip("\ufffd"))
        assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == result.tokens


def test_eos_stops_and_is_not_emitted(engine):
    prompt = [5, 9, 11]
    full = engine.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True), draft=0)
    eos = next(iter(engine.eos_ids))
    # Force an EOS into the output by treating the 5th generated token as EOS.
    engine.eos_ids = {full.tokens[4]}
    try:
        for draft in (0, None):
            out = engine.generate(prompt, SamplingParams(max_tokens=60), draft)
            assert out.tokens == full.tokens[:full.tokens.index(full.tokens[4])]
            assert out.finish_reason == "stop" and out.stop_type == "eos"
    finally:
        engine.eos_ids = {eos}


def test_max_tokens_exact_with_drafting(engine):
    for n in (1, 2, 7, 8, 9, 33):
        out = engine.generate([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True), draft=engine.max_draft)
        assert len(out.tokens) == n and out.finish_reason == "length"


def test_context_full_stops_with_length(qwen3_dir, drafter_dir):
    from flashdraft.engine.generator import Engine
    eng = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=40)
    out = eng.generate(list(range(30)), SamplingParams(max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length" and 30 + len(out.tokens) == 40


def test_closing_the_stream_stops_generation(engine):
    stream = engine.stream([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), 0)
    next(stream)
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)


def test_utf8_never_split(engine):
    """Streamed text never ends inside a multi-byte character; the joined stream equals the final text."""
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=60, ignore_eos=True)
    events = list(engine.stream([1, 2, 3], params))
    streamed = "".join(e.text for e in events if isinstance(e, Delta))
    assert streamed == events[-1].text


def test_threads_flag(qwen3_dir, drafter_dir, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls = []
    rc = main(["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "-p", "hi", "-n", "3", "--device", "cpu",
               "-c", "64", "-t", "2", "--json"])
    assert rc == 0 and calls == [2]
    capsys.readouterr()
    assert main(["generate", "-m", str(qwen3_dir), "-p", "hi", "-t", "0"]) == 1
    assert "-t/--threads must be >= 1" in capsys.readouterr().err


def test_no_drafter_is_resolved_when_drafting_is_off(monkeypatch, tmp_path):
    """resolve_model_paths fills in the demo drafter only when drafting is on (serve --spec-type none and
    generate --no-draft must load no drafter)."""
    from flashdraft.cli import resolve_model_paths
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setattr("flashdraft.demo.DEMO_DIR", tmp_path)
    assert resolve_model_paths(None, None) == (str(tmp_path / "target"), str(tmp_path / "drafter"))  # old call
    assert resolve_model_paths(None, None, draft=True) == (str(tmp_path / "target"), str(tmp_path / "drafter"))
    assert resolve_model_paths(None, None, draft=False) == (str(tmp_path / "target"), None)
    assert resolve_model_paths(None, "/my/drafter", draft=False) == (str(tmp_path / "target"), None)
    assert resolve_model_paths("/m", "/d", draft=False) == ("/m", None)
    assert resolve_model_paths("/m", "/d") == ("/m", "/d")
    assert resolve_model_paths("/m", None) == ("/m", None)  # an explicit model never gets the demo drafter


def test_generate_no_draft_loads_no_drafter(qwen3_dir, drafter_dir, capsys, monkeypatch):
    from flashdraft.engine.generator import Engine
    loaded = []
    load = Engine.load

    def spy(model, drafter=None, **kwargs):
        loaded.append(drafter)
        return load(model, drafter, **kwargs)

    monkeypatch.setattr(Engine, "load", staticmethod(spy))
    rc = main(["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "--no-draft", "-p", "hi", "-n", "3",
               "--device", "cpu", "-c", "64", "--json"])
    assert rc == 0 and loaded == [None]
    assert json.loads(capsys.readouterr().out)["draft_n"] == 0


def test_generate_uses_the_controller_priced_for_its_engine(qwen3_dir, drafter_dir, capsys, monkeypatch):
    """Without --draft-n, generate drafts with AdaptiveDraft.for_engine (a cost fixed at load); --no-adaptive
    drafts the full block."""
    from flashdraft.engine import generator
    made = []
    for_engine = generator.AdaptiveDraft.for_engine.__func__

    def spy(cls, engine, config=None):
        made.append(for_engine(cls, engine, config))
        return made[-1]

    monkeypatch.setattr(generator.AdaptiveDraft, "for_engine", classmethod(spy))
    base = ["generate", "-m", str(qwen3_dir), "-md", str(drafter_dir), "-p", "def add(a, b):", "-n", "10",
            "--device", "cpu", "-c", "64", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(made) == 1 and made[0].steps == out["steps"] and made[0].cost != generator.DraftCost()
    assert main(base + ["--no-adaptive"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(made) == 1 and "7" in out["draft_lengths"]


def test_a_generation_summary_line():
    """The line `generate` prints and the server logs: speed, prompt, drafting (when any), the end, the seed."""
    from flashdraft.engine.generator import GenerationResult, GenerationStats

    stats = GenerationStats(prompt_n=12, prompt_ms=30.4, predicted_n=40, predicted_ms=500.0)
    for drafted, accepted in ((7, 7), (7, 2), (0, 0)):
        stats.record_step(drafted, accepted)
    result = GenerationResult(text="", tokens=[], finish_reason="length", stop_type="limit", stopping_word="",
                              seed=5, stats=stats)
    assert result.summary() == ("40 tokens in 0.50 s: 80.0 tok/s; prompt 12 tokens in 30 ms; tau 4.00, acceptance "
                                "9/14 (64.3%); finish length (limit); seed 5")
    plain = GenerationResult(text="", tokens=[], finish_reason="stop", stop_type="eos", stopping_word="", seed=1,
                             stats=GenerationStats(prompt_n=3, predicted_n=2, predicted_ms=10.0))
    assert "tau" not in plain.summary() and plain.summary().endswith("finish stop (eos); seed 1")
