"""Incremental detokenization (flashdraft.loading.tokenizer.IncrementalText): always the text a full decode gives, for a
byte-level BPE (characters split over tokens) and a SentencePiece-style decoder (the first token's space
dropped), at a cost that does not grow with the output."""
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from flashdraft.loading.tokenizer import IncrementalText
from flashdraft.loading.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "src" / "flashdraft" / "demo" / "target"


def _check(decode, vocab_ids, seed, steps=60):
    rng = random.Random(seed)
    inc = IncrementalText(decode)
    tokens = []
    for _ in range(steps):
        tokens += [rng.choice(vocab_ids) for _ in range(rng.randint(1, 16))]
        assert inc.text(tokens) == decode(tokens)
        for k in rng.sample(range(len(tokens) + 1), min(6, len(tokens) + 1)):
            assert inc.length_at(tokens, k) == len(decode(tokens[:k]))
    return inc


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_bpe(seed):
    tok = Tokenizer(DEMO)
    text = "def f(x):\n    return 'héllo wörld ✓ 日本語 🙂' * x\n"
    ids = sorted(set(tok.encode(text * 3)) | set(random.Random(seed).sample(range(len(tok.hf)), 200)))
    inc = _check(tok.decode, ids, seed)
    assert not inc.exact_only and len(inc.marks) > 10  # the window trick ran, with marks advancing


def test_sentencepiece_style_leading_space():
    vocab = {w: i for i, w in enumerate(["<unk>", "▁hello", "▁world", "lo", "▁", "x", "▁a", "b"])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace()
    decode = lambda ids: hf.decode(ids)  # noqa: E731
    assert decode([1, 2]) == "hello world"  # the first token's space is dropped, later ones kept
    inc = _check(decode, list(range(1, 8)), seed=5)
    assert not inc.exact_only


def test_a_decoder_the_window_does_not_fit_falls_back_to_full_decodes():
    decode = lambda ids: f"[{len(ids)}]" + "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    inc = _check(decode, list(range(30)), seed=1, steps=10)
    assert inc.exact_only


def test_work_does_not_grow_with_the_output():
    tok = Tokenizer(DEMO)
    decoded = []
    inc = IncrementalText(lambda ids: decoded.append(len(ids)) or tok.decode(ids))
    ids = tok.encode("for i in range(10):\n    print(i * i)\n" * 200)[:2000]
    for end in range(4, len(ids) + 1, 4):
        inc.text(ids[:end])
    assert max(decoded[10:]) < 64  # each call decodes a short window, never the whole output
