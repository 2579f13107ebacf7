"""Per-token grammar mask cost of llguidance and xgrammar on this CPU, with the demo tokenizer.

Both compile the same grammars: JSON on one line with ", " and ": " (as engine.grammar configures xgrammar; the
xgrammar side is engine.grammar's own compiler and matcher), a GBNF grammar. For each engine and grammar: the
one-off tokenizer preparation, the grammar's compile time, and, walking the tokens of a valid output one at a
time, the time to compute the next-token mask and to advance the matcher (plain decoding's per-token cost);
then DFlash's per-step pattern on the same output: the masks of a block's rows (advancing over its guesses,
then back), half of the guesses committed after each. Run:

    pip install llguidance  # not a dependency of the package
    python scripts/grammar_mask_cost.py [--reps 20] [--block 15]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from flashdraft.config import Constraint
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.grammar import GrammarCompiler, GrammarMatcher
from flashdraft.loading import Tokenizer

# llguidance's JSON options that give engine.grammar's JSON: no free whitespace, json.dumps' separators
MAX_BLOCK = 64
LL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"},
            "scores": [9.5, 7.25, 10]}

GBNF = r'''root ::= "def " name "(" params? "):" ws "return " expr
name ::= [a-z_] [a-z0-9_]*
params ::= name (", " name)*
expr ::= term (" " op " " term)*
term ::= name | [0-9]+
op ::= "+" | "-" | "*"
ws ::= "\n" " "{4}'''
GBNF_TEXT = "def add_three(first, second, third):\n    return first + second + third * 2 - 17"


def grammars():
    """(name, output text, llguidance grammar, our Constraint) for each measured grammar."""
    instance = json.dumps(INSTANCE)
    json_grammar = llguidance.LLMatcher.grammar_from_json_schema
    return [
        ("json_schema", instance, json_grammar(json.dumps(SCHEMA), overrides=LL_JSON),
         Constraint("json_schema", json.dumps(SCHEMA))),
        ("json_object", instance, json_grammar('{"type": "object"}', overrides=LL_JSON), Constraint("json_object")),
        ("gbnf", GBNF_TEXT, llguidance.grammar_from("gbnf", GBNF), Constraint("gbnf", GBNF)),
    ]


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        t = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.prepare_s = time.perf_counter() - t
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, grammar, _):
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m):
        llguidance.torch.fill_next_token_bitmask(m, self.mask)

    def advance(self, m, token):
        assert m.consume_token(token), m.get_error()

    def block_masks(self, m, guesses):
        for tok in guesses:
            self.fill(m)
            self.advance(m, tok)
        self.fill(m)
        m.rollback(len(guesses))


class XGrammar:
    """Through engine.grammar, as the engine uses it."""
    name = "xgrammar"

    def __init__(self, hf, vocab, eos):
        t = time.perf_counter()
        self.compiler = GrammarCompiler(hf, vocab, eos)
        self.prepare_s = time.perf_counter() - t
        self.vocab = vocab

    def compile(self, _, constraint):
        self.compiler._compiler.clear_cache()  # compiled from scratch, not found in the cache
        return GrammarMatcher(self.compiler.compile(constraint), self.vocab, MAX_BLOCK + 1)

    def fill(self, m):
        m.masks([])

    def advance(self, m, token):
        m.commit([token])

    def block_masks(self, m, guesses):
        m.masks(guesses)


def measure(engine, grammar, constraint, tokens, reps, block):
    compile_s, fill_s, advance_s, step_s = [], [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        m = engine.compile(grammar, constraint)
        compile_s.append(time.perf_counter() - t)
        for tok in tokens:
            t = time.perf_counter()
            engine.fill(m)
            t1 = time.perf_counter()
            engine.advance(m, tok)
            fill_s.append(t1 - t)
            advance_s.append(time.perf_counter() - t1)
        # DFlash: per step, the masks of a block's rows (advancing over the guesses, then back); then half of
        # the guesses are committed.
        m = engine.compile(grammar, constraint)
        pos = 0
        while pos + block <= len(tokens):
            t = time.perf_counter()
            engine.block_masks(m, tokens[pos:pos + block])
            step_s.append(time.perf_counter() - t)
            for tok in tokens[pos:pos + block // 2]:
                engine.advance(m, tok)
            pos += block // 2
    ms = 1000
    return {"compile_ms": ms * statistics.median(compile_s), "mask_ms": ms * statistics.mean(fill_s),
            "mask_p50_ms": ms * statistics.median(fill_s), "mask_max_ms": ms * max(fill_s),
            "advance_ms": ms * statistics.mean(advance_s),
            "step_ms": ms * statistics.mean(step_s) if step_s else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block", type=int, default=15, choices=range(1, MAX_BLOCK + 1), metavar="N",
                    help="guesses per DFlash step (15: the demo drafter's block of 16)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer(DEMO_DIR / "target")
    vocab = json.loads((DEMO_DIR / "target" / "config.json").read_text())["vocab_size"]
    eos = json.loads((DEMO_DIR / "target" / "generation_config.json").read_text())["eos_token_id"]
    engines = [LLGuidance(tok.hf, vocab), XGrammar(tok.hf, vocab, eos)]
    print(f"demo tokenizer, vocab {vocab}; {args.reps} reps; DFlash step: the masks of {args.block} guesses + 1")
    for e in engines:
        print(f"{e.name}: tokenizer preparation {1000 * e.prepare_s:.0f} ms (once per model)")
    print("| grammar | engine | tokens | compile ms | mask ms (mean / p50 / max) | advance ms | DFlash step ms |")
    print("|---|---|---|---|---|---|---|")
    for name, text, ll_grammar, constraint in grammars():
        tokens = tok.encode(text, add_special_tokens=False)
        for e in engines:
            r = measure(e, ll_grammar, constraint, tokens, args.reps, args.block)
            print(f"| {name} | {e.name} | {len(tokens)} | {r['compile_ms']:.2f} | {r['mask_ms']:.4f} / "
                  f"{r['mask_p50_ms']:.4f} / {r['mask_max_ms']:.3f} | {r['advance_ms']:.4f} | {r['step_ms']:.3f} |")


if __name__ == "__main__":
    main()
