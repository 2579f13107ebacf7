"""Every stage of the demo-pair pipeline at toy scale on the CPU: corpus -> tokenizer -> target -> prompts ->
drafter (flashdraft train-drafter) -> evaluate -> package, then the packaged pair in the engine."""
import json

import numpy as np
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.demo.pipeline import bpe, corpus, evaluate, package, pretrain, prompts
from flashdraft.engine.generator import Engine


def write_modules(root, count=24):
    for i in range(count):
        funcs = "\n\n".join(
            f'def scale_{i}_{j}(x, y={j}):\n    """Return x plus {j} times y."""\n    total = x + {j} * y\n'
            f'    return total\n' for j in range(4))
        method = (f'class Thing{i}:\n    def double(self, a):\n        """Double a and add {i}."""\n'
                  f'        b = a * 2\n        return b + {i}\n')
        folder = root / f"pkg{i % 8}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i}.py").write_text(f"import os\n\n\n{funcs}\n\n\n{method}")
    (root / "pkg0" / "copy.py").write_text((root / "pkg0" / "mod0.py").read_text())  # a duplicate
    (root / "pkg0" / "tiny.py").write_text("x = 1\n")                              # too small to keep


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: the toy models are too small to gain from more, and a busy machine makes them lose."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    """All stages once; the tests below check what each left behind."""
    root = tmp_path_factory.mktemp("demo")
    src, run = root / "src", root / "run"
    write_modules(src)
    assert corpus.main(["--out", str(run / "corpus"), "--roots", str(src), "--max-mb", "1",
                        "--held-out-percent", "40", "--chat-fraction", "0.5", "--workers", "1"]) == 0
    assert bpe.main(["--corpus", str(run / "corpus"), "--out", str(run / "tokenizer"), "--vocab", "400",
                     "--model-max-length", "64"]) == 0
    assert pretrain.main(["--tokenizer", str(run / "tokenizer"), "--out", str(run / "target"),
                          "--log", str(run / "logs" / "target.jsonl"), "--hidden", "32", "--layers", "4",
                          "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--seq-len", "64",
                          "--batch-size", "8", "--steps", "24", "--warmup", "4", "--lr", "5e-3",
                          "--log-every", "8", "--eval-every", "8", "--eval-windows", "4", "--device", "cpu"]) == 0
    assert prompts.main(["--corpus", str(run / "corpus"), "--tokenizer", str(run / "tokenizer"),
                         "--out", str(run / "prompts"), "--train", "12", "--heldout", "8", "--max-chars", "80",
                         "--long-tokens", "10", "30"]) == 0
    (run / "handwritten.jsonl").write_text(json.dumps({"kind": "signature", "prompt": "def scale_3(x):"}) + "\n")
    from flashdraft.train.cli import main as train_drafter
    assert train_drafter(["--target", str(run / "target"), "--prompts", str(run / "prompts" / "train.jsonl"),
                          "--out", str(run / "drafter_train"), "--block-size", "4", "--layers", "1",
                          "--max-new-tokens", "12", "--steps", "3", "--batch-size", "4", "--anchors", "4",
                          "--eval-prompts", "0", "--device", "cpu", "-q"]) == 0
    assert evaluate.main(["--target", str(run / "target"), "--drafter", str(run / "drafter_train"),
                          "--prompts", str(run / "prompts"), "--out", str(run / "eval"), "--device", "cpu",
                          "--max-tokens", "12", "--speed-prompts", "2", "--samples", "1",
                          "--handwritten", str(run / "handwritten.jsonl")]) == 0
    assert package.main(["--run", str(run), "--out", str(root / "pair")]) == 0
    return run, root / "pair"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_corpus_dedupes_filters_and_splits(run):
    stats = json.loads((run[0] / "corpus" / "stats.json").read_text())
    assert stats["duplicates"] == 1 and stats["rejected"] == 1
    assert stats["train_files"] + stats["heldout_files"] == 24 and stats["heldout_files"] >= 1
    train, held_out = read_jsonl(run[0] / "corpus" / "train.jsonl"), read_jsonl(run[0] / "corpus" / "heldout.jsonl")
    assert not {d["module"] for d in train} & {d["module"] for d in held_out}
    # whole projects are held out: no project has files in both splits
    assert not {d["project"] for d in train} & {d["project"] for d in held_out}
    assert {d["project"] for d in held_out} == set(stats["heldout_projects"]) and len(stats["heldout_projects"]) >= 2
    fn = read_jsonl(run[0] / "corpus" / "functions_train.jsonl")[0]
    assert fn["code"].startswith(("def ", "class ")) and fn["name"] in fn["request"]


def test_chat_samples_match_the_chat_template(run):
    """Chat samples in the token stream are tokenized exactly as the engine renders a user message."""
    from tokenizers import Tokenizer as RawTokenizer

    from flashdraft.loading import Tokenizer
    tok = Tokenizer(run[0] / "target")
    enc = bpe.ChatEncoder(RawTokenizer.from_file(str(run[0] / "target" / "tokenizer.json")))
    request = "Write a Python function `scale(x)`. Return x doubled."
    assert tok.encode_chat([{"role": "user", "content": request}]) == enc.prompts([request])[0]
    # File text never turns into special tokens.
    assert enc.ids[bpe.MASK] not in enc.text(["s = '<|mask|>'"])[0]


def test_tokenizer_folder(run):
    cfg = json.loads((run[0] / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"] and cfg["eos_token"] == "<|im_end|>"
    meta = json.loads((run[0] / "tokenizer" / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == 400 and meta["train_tokens"] > 1000 and meta["heldout_tokens"] > 0
    stream = np.fromfile(run[0] / "tokenizer" / "tokens" / "train.bin", dtype=np.uint16)
    assert stream.size == meta["train_tokens"] and stream.max() < 400
    ids = meta["special_ids"]
    chats = json.loads((run[0] / "corpus" / "stats.json").read_text())["train_functions"]
    assert chats > 0  # each chat sample: a user turn and an assistant turn, each closed
    assert (stream == ids["<|im_start|>"]).sum() == (stream == ids["<|im_end|>"]).sum() == 2 * chats
    assert (stream == ids["<|mask|>"]).sum() == 0


def test_a_line_break_is_a_token_of_its_own(run):
    """A prompt that ends at a line break ends on a token boundary of the full text, as in training."""
    from tokenizers import Tokenizer as RawTokenizer
    tok = RawTokenizer.from_file(str(run[0] / "tokenizer" / "tokenizer.json"))
    head, full = "def scale(x):\n", "def scale(x):\n    total = x + 1\n    return total\n"
    head_ids, full_ids = tok.encode(head).ids, tok.encode(full).ids
    assert full_ids[:len(head_ids)] == head_ids
    assert tok.decode(full_ids) == full


def test_target_loss_falls(run):
    log = read_jsonl(run[0] / "logs" / "target.jsonl")
    first = next(r for r in log if r.get("step") == 1)
    done = log[-1]
    assert done["event"] == "done" and done["steps"] == 24
    assert done["final_train_loss"] < first["train_loss"] - 0.5
    assert done["final_heldout_loss"] < first["train_loss"]


def test_packaged_pair_loads_and_decodes_losslessly(run):
    pair = run[1]
    assert sorted(p.name for p in (pair / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    gen = json.loads((pair / "target" / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [0, 2]  # <|endoftext|> and <|im_end|>
    engine = Engine.load(pair / "target", pair / "drafter", device="cpu")
    assert engine.has_drafter and engine.context_size == 64
    ids = engine.encode_prompt(messages=[{"role": "user", "content": "Write a Python function `scale_1_2`."}])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert engine.generate(ids, params).tokens == engine.generate(ids, params, draft=0).tokens
    report = (pair / "report.md").read_text()
    assert "tau, held-out code" in report and "## Samples" in report


def test_evaluation_report(run):
    ev = json.loads((run[0] / "eval" / "eval.json").read_text())
    assert ev["code"]["prompts"] >= 1 and ev["prose"]["prompts"] >= 1 and ev["block_size"] == 4
    assert 1.0 <= ev["code"]["tau"] <= 4.0
    assert ev["handwritten"]["prompts"] == 1 and ev["handwritten"]["eos_first"] in (0, 1)
    long = ev["code_long"]
    assert long["prompts"] >= 1 and 10 <= long["prompt_tokens"][0] <= long["prompt_tokens"][1] <= 30
    assert ev["speed"]["identical"] == ev["speed"]["prompts"] == 2


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert corpus.main(["--out", str(tmp_path / "c"), "--roots", str(tmp_path / "nothing")]) == 1
    assert "no .py files" in capsys.readouterr().err
    assert bpe.main(["--corpus", str(tmp_path), "--out", str(tmp_path / "t"), "--vocab", "100"]) == 1
    assert "vocab size" in capsys.readouterr().err
