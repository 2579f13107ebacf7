"""The cost of grammar masks on the GPU (issue #22): decoding with and without a json_schema constraint.

Synthetic Qwen3-8B shape (random bf16 weights, 151,936-token vocabulary) with a synthetic byte-level vocabulary of
that size (random fragments: xgrammar's mask cost grows with the vocabulary, not with the weights). Greedy, up
to 256 tokens after a 64-token prompt (the schema's 64-item array keeps the constrained output long):
- plain decoding, unconstrained and constrained;
- DFlash with a planted oracle (bench.oracle.PlantedOracle: the drafter runs, then its guesses are replaced by
  the target's own next tokens with one wrong at a fixed place, so each step commits ACCEPT + 1 tokens),
  unconstrained (the pipelined graphed loop) and constrained (each step's guesses checked and masked on the
  host, the verify rows masked: engine.grammar).
xgrammar must be installed (on the GPU machine from carried wheels: pip install --no-deps WHEELS).

    PYTHONPATH=src python scripts/gpu/grammar_cost_run.py OUT_DIR
"""
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.bench.synthetic import build_synthetic
from flashdraft.config import Constraint, SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.bench.oracle import PlantedOracle
from flashdraft.loading import Tokenizer

ACCEPT = 5  # guesses accepted per DFlash step: tau 6
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 64},  # at least ~200 tokens
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}


def synthetic_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of vocab_size entries: the 256 byte symbols, then random fragments of letters,
    digits and JSON punctuation (half with GPT-2's leading-space mark), then the end token. No merges: only the
    vocabulary matters here (the grammar engine reads it; prompts are token ids)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(sorted(byte_symbols))}
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_" + '{}[]":,.-'
    while len(vocab) < vocab_size - 1:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(("Ġ" if rng.random() < 0.5 else "") + piece, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    hf.save_pretrained(folder)
    return Tokenizer(folder)


def timed(engine: Engine, prompt: list[int], params: SamplingParams, draft: int, sequence=None) -> dict:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompt, params, draft, sequence=sequence)
    torch.cuda.synchronize()
    s = out.stats
    return {"tokens": len(out.tokens), "tok_s": (s.predicted_n - 1) / (s.predicted_ms / 1000), "tau": s.tau,
            "wall_s": time.perf_counter() - start, "ids": out.tokens}


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    target, drafter = build_synthetic("qwen3-8b", dev, torch.bfloat16, 1024)
    vocab = target.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        tokenizer = synthetic_tokenizer(Path(tmp), vocab)
        print(f"synthetic tokenizer of {vocab} entries in {time.perf_counter() - start:.1f} s", flush=True)
        engine = Engine(target, tokenizer, drafter, context_size=1024)
        constraint = Constraint("json_schema", json.dumps(SCHEMA))
        start = time.perf_counter()
        engine.compile_constraint(constraint)
        print(f"schema compiled in {time.perf_counter() - start:.2f} s", flush=True)
    prompt = torch.randint(10, vocab - 10, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    free = SamplingParams(max_tokens=256, ignore_eos=True)
    bound = SamplingParams(max_tokens=256, constraint=constraint)  # ends where the grammar does
    report = {"device": torch.cuda.get_device_name(), "accept": ACCEPT, "rows": {}}
    B = drafter.block_size
    for name, params in (("unconstrained", free), ("json_schema", bound)):
        engine.generate(prompt, params, 0)  # warm-up: graphs, compiles, the grammar's caches
        plain = timed(engine, prompt, params, 0)
        oracle = PlantedOracle(prompt + plain["ids"], lambda s: ACCEPT, vocab, dev)
        planted = engine.new_sequence(oracle=oracle)
        engine.generate(prompt, params, B - 1, sequence=planted)  # captures every verify length this pattern needs
        oracle.reset()
        dflash = timed(engine, prompt, params, B - 1, planted)
        same = dflash["ids"] == plain["ids"]
        report["rows"][name] = {"plain": {k: v for k, v in plain.items() if k != "ids"},
                                "dflash": {k: v for k, v in dflash.items() if k != "ids"}, "identical": same}
        print(f"{name:13s} plain {plain['tok_s']:7.1f} tok/s ({plain['tokens']} tokens); DFlash {dflash['tok_s']:7.1f} "
              f"tok/s at tau {dflash['tau']:.2f}; same tokens: {same}", flush=True)
    text = tokenizer.hf.decode(plain["ids"])
    report["constrained_text_starts"] = text[:200]
    try:
        json.loads(text)
        report["constrained_output_parses"] = True
    except ValueError:
        report["constrained_output_parses"] = False  # 256 tokens may end inside the object
    free_row, bound_row = report["rows"]["unconstrained"], report["rows"]["json_schema"]
    for way in ("plain", "dflash"):
        ratio = bound_row[way]["tok_s"] / free_row[way]["tok_s"]
        print(f"{way}: constrained / unconstrained = {ratio:.3f}")
        report[f"{way}_ratio"] = ratio
    print("constrained output starts:", repr(text[:120]))
    (out / "grammar_cost.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
