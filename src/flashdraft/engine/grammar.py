"""Grammar-constrained output through xgrammar: constraints compiled against the model's vocabulary, and a
matcher per request that gives the next-token masks of a verify block's rows.

xgrammar was chosen over llguidance by per-token mask cost (docs/performance.md, scripts/grammar_mask_cost.py):
it precomputes most of each grammar's token masks at compile time, so the up to 16 masks of a DFlash step
cost little. Special tokens (chat markers and the like) decode to no text, so the grammar must never let
one through as if it were its literal name: they are blanked in the vocabulary xgrammar sees, which makes
them special to it (never allowed, except the end-of-sequence tokens, which end a complete output).
xgrammar is imported at the first constrained request: it costs about 1.6 s of start-up that plain generation
does not need.
"""
from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from flashdraft.config import Constraint

if TYPE_CHECKING:
    import xgrammar

# JSON is written on one line with ", " and ": " between items (as json.dumps writes it): free whitespace lets a
# weak model fill its output with blanks between tokens (the demo target did, until max_tokens).
JSON_OPTIONS = {"any_whitespace": False}
# Compiled grammars kept for reuse (a client sends the same schema request after request).
CACHE_BYTES = 256 << 20

# xgrammar's messages start with a time stamp and the C++ source position, and some with its check's text.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@functools.cache
def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured output needs the xgrammar package, which did not import ({e}); "
                           "pip install xgrammar") from e
    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; compiled grammars are cached by source. Thread-safe (the
    server compiles while checking a request, the worker again when it runs it, from the cache)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        xgr = _xgrammar()
        stop = sorted(eos_ids)
        if not stop:
            raise ValueError("this model has no end-of-sequence token, so a grammar's end could not end the output")
        detected = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        vocab = [""] * vocab_size
        for text, i in hf_tokenizer.get_vocab().items():
            if i < vocab_size:
                vocab[i] = text
        special = set(hf_tokenizer.all_special_ids)
        special |= {i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if t.special}
        for i in special:
            if 0 <= i < vocab_size:
                vocab[i] = ""
        self.info = xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                                      add_prefix_space=detected.add_prefix_space)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, cache_limit_bytes=CACHE_BYTES)
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        """The constraint's grammar; ValueError with xgrammar's message when it does not compile."""
        constraint.validate()
        c = self._compiler
        try:
            with self._lock:
                if constraint.kind == "json_object":  # any object: properties not listed are allowed
                    return c.compile_json_schema('{"type": "object"}', strict_mode=False, **JSON_OPTIONS)
                if constraint.kind == "json_schema":
                    return c.compile_json_schema(constraint.source, **JSON_OPTIONS)
                if constraint.kind == "gbnf":
                    return c.compile_grammar(constraint.source)
                return c.compile_regex(constraint.source)
        except RuntimeError as e:
            raise ValueError(f"invalid {constraint.kind}: {_NOISE.sub('', str(e)).strip()}") from e


class GrammarMatcher:
    """A request's position in its grammar: the committed tokens, and the masks of a verify block's rows."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, max_rows: int):
        xgr = _xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        # Special tokens other than the stop tokens are never allowed; draft() skips them without asking the
        # matcher, which would print a warning for each.
        info = compiled.tokenizer_info
        self._never = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._words = self._bitmask.numpy()  # the same memory, for reading single bits quickly

    def masks(self, guesses: list[int]) -> torch.Tensor:
        """Bitmasks (int32, 32 tokens a word, on the host; valid until the next call) of the rows after
        guesses[:i], for i = 0, 1, ... up to the first guess the grammar forbids: the rows after that guess can
        never be reached, because the row before masks it out. The matcher is left where it was."""
        m = self._matcher
        rows = advanced = 0
        for i in range(len(guesses) + 1):
            if m.is_terminated():  # the guess before was an end of sequence: the rest is past the output
                break
            m.fill_next_token_bitmask(self._bitmask, rows)
            rows += 1
            if i == len(guesses) or not m.accept_token(guesses[i]):
                break
            advanced += 1
        if advanced:
            m.rollback(advanced)
        return self._bitmask[:rows]

    def draft(self, candidates: list[list[int]]) -> list[int]:
        """Guesses for a block's slots: each the first of its slot's candidates (best first) that the grammar
        accepts after the guesses before it, else the one token the grammar allows there if it allows only one;
        a slot with neither ends the guesses. Tried by accepting tokens, not by filling masks (a mask is filled
        only to find a forced token): the verify rows' masks (masks()) are filled afterwards, while the GPU runs
        the verify pass. The matcher is left where it was."""
        m, guesses = self._matcher, []
        for slot in candidates:
            if m.is_terminated():
                break
            pick = next((t for t in slot if 0 <= t < self.vocab_size and t not in self._never and m.accept_token(t)),
                        None)
            if pick is None:
                m.fill_next_token_bitmask(self._bitmask, 0)
                pick = _only_token(self._words[0])
                if pick is None or not m.accept_token(pick):
                    break
            guesses.append(pick)
        if guesses:
            m.rollback(len(guesses))
        return guesses

    def commit(self, tokens: list[int]) -> None:
        """Advance over committed tokens (tokens after an end of sequence are past the output: ignored)."""
        m = self._matcher
        for t in tokens:
            if m.is_terminated():
                return
            if not m.accept_token(t):
                raise RuntimeError(f"token {t} was committed, but the grammar forbids it: a mask was not applied")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[rows, vocab] bool: which tokens each row of a bitmask allows."""
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = (bitmask.to(device)[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _only_token(words: np.ndarray) -> int | None:
    """The one token a bitmask row allows (a grammar's forced token), or None when it allows several."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    if np.count_nonzero(bits) != 1:
        return None
    return int(np.flatnonzero(bits)[0])
