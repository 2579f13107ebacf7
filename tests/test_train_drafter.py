"""train-drafter end to end on CPU: the loss falls, the folder loads in the engine, decoding stays lossless,
and an interrupted run resumes to the same weights."""
import json

import pytest
import torch
from safetensors import safe_open

import flashdraft.train.trainer as trainer
from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.train.cli import main as train_main
from flashdraft.train.trainer import TrainConfig, train_drafter

PROMPTS = ["def add(a, b):", "for i in range(10):", "The quick brown fox", "class Stack:", "import os",
           "Hello, world!", "def main():", "while True:", "if __name__ ==", "x = [1, 2,"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return f


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One response cache shared by the runs below (same target, prompts and generation settings)."""
    return tmp_path_factory.mktemp("responses")


def small(qwen3_dir, prompt_file, data_dir, out, **kw):
    base = dict(target=str(qwen3_dir), prompts=str(prompt_file), out=str(out), layers=1, block_size=4,
                steps=40, lr=5e-3, batch_size=4, anchors=8, max_new_tokens=20, gen_batch_size=8,
                data_dir=str(data_dir), eval_prompts=2, eval_max_tokens=12, device="cpu", log_every=5,
                save_dtype="float32", progress=False)
    return TrainConfig(**{**base, **kw})


def test_train_load_and_lossless(qwen3_dir, prompt_file, data_dir, tmp_path):
    report = train_drafter(small(qwen3_dir, prompt_file, data_dir, tmp_path / "d"))
    log = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 8
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]  # windows of 5 steps: the loss falls
    assert report["held_out"]["prompts"] == 2 and report["held_out"]["tau"] >= 1.0
    assert json.loads((tmp_path / "d" / "train_report.json").read_text())["steps"] == 40

    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # frozen target parts are not saved

    engine = Engine.load(qwen3_dir, tmp_path / "d", device="cpu", context_size=128)
    assert engine.max_draft == 3
    for prompt in ("def add(a, b):", "class Queue:"):
        ids = engine.encode_prompt(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        with_draft = engine.generate(ids, params)
        assert with_draft.stats.draft_n > 0
        assert with_draft.tokens == engine.generate(ids, params, draft=0).tokens


def test_resume_continues_the_same_run(qwen3_dir, prompt_file, data_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train_drafter(small(qwen3_dir, prompt_file, data_dir, straight, steps=8, save_every=4, eval_prompts=0))

    broken = tmp_path / "broken"
    real_step, calls = trainer.train_step, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_step(*args, **kw)

    monkeypatch.setattr(trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(small(qwen3_dir, prompt_file, data_dir, broken, steps=8, save_every=4, eval_prompts=0))
    monkeypatch.setattr(trainer, "train_step", real_step)
    assert torch.load(broken / "checkpoint.pt", weights_only=False)["step"] == 4
    with pytest.raises(ValueError, match="--resume"):
        train_drafter(small(qwen3_dir, prompt_file, data_dir, broken, steps=8, save_every=4, eval_prompts=0))
    train_drafter(small(qwen3_dir, prompt_file, data_dir, broken, steps=8, save_every=4, eval_prompts=0,
                        resume=True))

    def weights(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
            return {k: st.get_tensor(k) for k in st.keys()}
    a, b = weights(straight), weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_errors_name_the_problem(qwen3_dir, prompt_file, tmp_path, capsys):
    base = ["--target", str(qwen3_dir), "--out", str(tmp_path / "o"), "--device", "cpu", "-q"]
    assert train_main(base + ["--prompts", str(tmp_path / "missing.txt")]) == 1
    assert "prompt file not found" in capsys.readouterr().err
    assert train_main(base + ["--prompts", str(prompt_file), "--tap-ids", "1,9"]) == 1
    assert "tap ids [9] out of range" in capsys.readouterr().err
    assert train_main(base + ["--prompts", str(prompt_file), "--mask-token-id", "100000"]) == 1
    assert "not a row of the target embedding" in capsys.readouterr().err
    assert train_main(base + ["--prompts", str(prompt_file), "--steps", "0"]) == 1
    assert "steps=0" in capsys.readouterr().err
