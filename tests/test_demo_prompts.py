"""The demo pipeline's prompt stage: the drafter's prompts and the tau prompts come from disjoint modules, and by
default neither from the target's training split."""
import json

import pytest

from flashdraft.demo.pipeline.prompts import build_prompts, measures_tau


def write_corpus(folder, modules_by_split):
    folder.mkdir()
    for split, modules in modules_by_split.items():
        files = [{"module": m, "text": "".join(f"{m}_line_{i} = {i}\n" for i in range(30))} for m in modules]
        functions = [{"module": m, "request": f"Write the function `f{j}` from module `{m}`."}
                     for m in modules for j in range(3)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in files))
        (folder / f"functions_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in functions))


def modules_in(path):
    out = set()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        text = r["messages"][-1]["content"] if "messages" in r else r["prompt"]
        out |= {w.split("_line_")[0].strip("`.") for w in text.split() if w.startswith(("held", "seen"))}
    return out


@pytest.mark.parametrize("source", ["heldout", "train"])
def test_drafter_and_tau_prompts_come_from_disjoint_modules(tmp_path, source):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, {"train": [f"seen{i}" for i in range(20)], "heldout": [f"held{i}" for i in range(40)]})
    stats = build_prompts(corpus, tmp_path / "p", train_count=60, heldout_count=12, seed=1, drafter_source=source)
    drafter, tau = modules_in(tmp_path / "p" / "train.jsonl"), modules_in(tmp_path / "p" / "heldout_code.jsonl")
    assert drafter and tau and not drafter & tau
    assert stats["drafter_prompts_from"] == source and stats["heldout_code"]["chat"] > 0
    if source == "heldout":
        assert all(m.startswith("held") and not measures_tau(m) for m in drafter)
        assert all(measures_tau(m) for m in tau)
    else:
        assert all(m.startswith("seen") for m in drafter) and all(m.startswith("held") for m in tau)
    with pytest.raises(ValueError, match="'heldout' or 'train'"):
        build_prompts(corpus, tmp_path / "q", 10, 4, drafter_source="corpus")
