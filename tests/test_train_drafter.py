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


def test_time_budgets_end_generation_and_training(qwen3_dir, prompt_file, tmp_path):
    """--gen-max-minutes: no batch after the first starts past it (training uses what exists); --max-minutes:
    training stops at its budget long before --steps, with the schedule annealed, and the drafter is saved."""
    fresh_data = tmp_path / "data"
    report = train_drafter(small(qwen3_dir, prompt_file, fresh_data, tmp_path / "d", steps=100_000,
                                 max_minutes=0.02, gen_batch_size=2, gen_max_minutes=1e-9, eval_prompts=0))
    batches = [json.loads(line) for line in (fresh_data / "generation.jsonl").read_text().splitlines()]
    assert len(batches) == 1 and batches[0]["prompts"] == 2 and batches[0]["tokens"] > 0
    assert report["responses"] == 2 < report["training_prompts"] == len(PROMPTS)
    assert 1 <= report["steps"] < 100_000
    log = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == report["steps"] and log[-1]["lr"] < 0.2 * 5e-3  # annealed by the time budget
    assert Engine.load(qwen3_dir, tmp_path / "d", device="cpu", context_size=128).max_draft == 3


def test_distillation_trains_a_lossless_drafter_from_cached_responses(qwen3_dir, prompt_file, data_dir, tmp_path):
    """--loss kd learns from the target's distributions: the loss falls and the drafter decodes losslessly.
    --generate-only fills the response cache and stops; --gen-max-minutes 0 trains on the cached responses only
    (none are generated), and says so when there are none."""
    warm = train_drafter(small(qwen3_dir, prompt_file, data_dir, tmp_path / "warm", generate_only=True,
                               eval_prompts=0))
    assert warm["responses"] == len(PROMPTS) and not (tmp_path / "warm" / "model.safetensors").exists()
    before = (data_dir / "responses.jsonl").read_text()
    report = train_drafter(small(qwen3_dir, prompt_file, data_dir, tmp_path / "kd", loss="kd", gen_max_minutes=0,
                                 eval_prompts=0))
    assert (data_dir / "responses.jsonl").read_text() == before  # nothing generated
    assert report["responses"] == len(PROMPTS) and report["train_config"]["loss"] == "kd"
    log = [json.loads(line) for line in (tmp_path / "kd" / "train_log.jsonl").read_text().splitlines()]
    # KD's loss is the teacher's entropy (near log V = 6.2 nats for this random target) plus the KL the drafter
    # can remove: it falls by the KL part only.
    assert log[-1]["loss"] < log[0]["loss"] - 0.1 and log[-1]["loss"] < min(r["loss"] for r in log[:3])
    engine = Engine.load(qwen3_dir, tmp_path / "kd", device="cpu", context_size=128)
    ids = engine.encode_prompt("def add(a, b):")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert engine.generate(ids, params).tokens == engine.generate(ids, params, draft=0).tokens

    with pytest.raises(ValueError, match="no responses in .*--gen-max-minutes 0"):
        train_drafter(small(qwen3_dir, prompt_file, tmp_path / "empty", tmp_path / "none", gen_max_minutes=0))


def test_distillation_loss_is_cross_entropy_against_the_teacher():
    """A teacher that is sure of the label gives plain cross-entropy; a teacher that spreads its mass asks the
    drafter to spread it too (and the loss is lowest when the drafter matches the teacher)."""
    from flashdraft.train.blocks import block_loss, slot_weights
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 11, generator=g), torch.randint(0, 11, (6,), generator=g)
    slots, w = torch.tensor([0, 1, 2, 0, 1, 2]), slot_weights(4, 7.0)
    sure = torch.full((6, 11), -1e4).scatter(1, labels[:, None], 0.0)
    ce, hits = block_loss(logits, labels, slots, w)
    kd, kd_hits = block_loss(logits, labels, slots, w, teacher_logits=sure)
    assert kd.item() == pytest.approx(ce.item(), rel=1e-5) and torch.equal(hits, kd_hits)
    teacher = torch.randn(6, 11, generator=g)
    matched, _ = block_loss(teacher.clone(), labels, slots, w, teacher_logits=teacher)
    other, _ = block_loss(logits, labels, slots, w, teacher_logits=teacher)
    assert matched.item() < other.item()


def test_lr_schedule_follows_progress():
    assert trainer.lr_factor(0.0, 0.1, 100) == pytest.approx(0.1)  # first step: 1 / warmup steps
    assert trainer.lr_factor(0.05, 0.1, 100) == pytest.approx(0.5)
    assert trainer.lr_factor(0.1, 0.1, 100) == pytest.approx(1.0)
    assert trainer.lr_factor(0.55, 0.1, 100) == pytest.approx(0.5)
    assert trainer.lr_factor(1.0, 0.1, 100) == pytest.approx(0.0, abs=1e-12)


def test_sigint_stops_at_a_step_boundary_with_the_drafter_saved(qwen3_dir, prompt_file, data_dir, tmp_path,
                                                                monkeypatch, request):
    """The pipeline's time caps send SIGINT: training stops after the step in flight, with the checkpoint and a
    loadable drafter folder, and --resume continues from there."""
    import os
    import signal
    # Python's own handler, whatever the suite started with (a shell's background job starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, before))
    real_step, calls = trainer.train_step, []

    def signalled(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kw)

    monkeypatch.setattr(trainer, "train_step", signalled)
    out = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        train_drafter(small(qwen3_dir, prompt_file, data_dir, out, steps=50, eval_prompts=0))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is gone again
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3
    assert Engine.load(qwen3_dir, out, device="cpu", context_size=128).max_draft == 3
    monkeypatch.setattr(trainer, "train_step", real_step)
    report = train_drafter(small(qwen3_dir, prompt_file, data_dir, out, steps=6, eval_prompts=0, resume=True))
    assert report["steps"] == 6


def test_sampler_groups_similar_lengths_and_covers_every_sequence_once_a_pass():
    import torch

    from flashdraft.train.trainer import Sampler
    lengths = [10 if i % 5 else 4000 for i in range(640)]  # one long sequence in five
    sampler = Sampler(len(lengths), torch.Generator().manual_seed(0), lengths)
    batches = [sampler.batch(8) for _ in range(80)]        # exactly one pass
    assert sorted(i for b in batches for i in b) == list(range(640))
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    plain = Sampler(len(lengths), torch.Generator().manual_seed(0))
    padded_plain = sum(max(lengths[i] for i in b) * len(b) for b in (plain.batch(8) for _ in range(80)))
    assert padded < 0.4 * padded_plain  # most batches hold only short sequences
    # long batches are spread over the pass, not gathered at its end
    has_long = [max(lengths[i] for i in b) == 4000 for b in batches]
    assert any(has_long[:40]) and any(has_long[40:])
