"""The demo pipeline's prompt stage: the drafter's prompts and the tau prompts come from disjoint projects, and by
default neither from the target's training split."""
import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from flashdraft.demo.pipeline.prompts import KINDS, build_prompts, signature_prefix, tau_projects


def write_tokenizer(folder):
    """Tokens split at "_", " ", "=" and line breaks (each its own token) size the long prompts:
    "held1_line_0 = 0\n" is 10 tokens."""
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[_ =\n]"), behavior="isolated")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_corpus(folder, modules_by_split):
    """One project per module, named like it; files of 30 lines, each of 3 words."""
    folder.mkdir()
    for split, modules in modules_by_split.items():
        files = [{"project": m, "module": m, "text": "".join(f"{m}_line_{i} = {i}\n" for i in range(30))}
                 for m in modules]
        functions = [{"project": m, "module": m, "request": f"Write the function `f{j}` from module `{m}`.",
                      "code": f"def {m}_f{j}(x):\n    y = x + {j}\n    return y\n"}
                     for m in modules for j in range(3)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in files))
        (folder / f"functions_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in functions))


def modules_in(path):
    out = set()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        text = r["messages"][-1]["content"] if "messages" in r else r["prompt"]
        out |= {w.split("_line_")[0].split("_f")[0].strip("`.") for w in text.split()
                if w.startswith(("held", "seen"))}
    return out


@pytest.mark.parametrize("source", ["heldout", "train"])
def test_drafter_and_tau_prompts_come_from_disjoint_modules(tmp_path, source):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, {"train": [f"seen{i}" for i in range(20)], "heldout": [f"held{i}" for i in range(40)]})
    tokenizer = write_tokenizer(tmp_path / "tok")
    stats = build_prompts(corpus, tmp_path / "p", tokenizer, train_count=60, heldout_count=12,
                          long_tokens=(20, 100), seed=1, drafter_source=source)
    drafter, tau = modules_in(tmp_path / "p" / "train.jsonl"), modules_in(tmp_path / "p" / "heldout_code.jsonl")
    assert drafter and tau and not drafter & tau
    assert stats["drafter_prompts_from"] == source and all(stats["heldout_code"][k] > 0 for k in KINDS)
    held = {f"held{i}" for i in range(40)}
    if source == "heldout":
        assert all(m in held - tau_projects(held) for m in drafter)
        assert tau <= tau_projects(held) == set(stats["tau_projects"])
    else:
        assert all(m.startswith("seen") for m in drafter) and all(m.startswith("held") for m in tau)
    with pytest.raises(ValueError, match="'heldout' or 'train'"):
        build_prompts(corpus, tmp_path / "q", tokenizer, 10, 4, drafter_source="corpus")


def test_long_prompts_are_file_starts_of_the_asked_length_in_tokens(tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, {"train": ["seen0"], "heldout": [f"held{i}" for i in range(8)]})
    tokenizer = write_tokenizer(tmp_path / "tok")
    build_prompts(corpus, tmp_path / "p", tokenizer, train_count=40, heldout_count=8, long_tokens=(20, 45), seed=3)
    longs = [json.loads(line) for line in (tmp_path / "p" / "train.jsonl").read_text().splitlines()]
    longs = [r["prompt"] for r in longs if r["kind"] == "long"]
    assert longs
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    for text in longs:
        assert text.endswith("\n") and "_line_0 = 0" in text.split("\n")[0]  # a file's start, whole lines
        assert 20 <= len(tok.encode(text).ids) <= 45


def test_signature_prompts_end_in_the_signature_or_inside_the_body():
    import random
    code = "@cache\ndef area(w,\n         h):\n    \"\"\"Area.\"\"\"\n    a = w * h\n    return a\n"
    seen = {signature_prefix(code, random.Random(seed)) for seed in range(40)}
    assert "def area(w,\n         h):" in seen                    # the def line(s) alone, no line break
    assert all(s.startswith("def area(w,") for s in seen)
    assert any(s.endswith("\n") and "return" not in s and len(s) > len("def area(w,\n         h):\n") - 1
               for s in seen)
    assert signature_prefix("x = 1\n", random.Random(0)) is None
