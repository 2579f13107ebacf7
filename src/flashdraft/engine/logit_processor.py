"""A request's logit processing (bias, penalties, grammar mask) on a verify block's rows, and its logprobs.

A verify pass gives rows [n + 1, V] for the positions after the committed tokens and after each prefix of the
drafter's n guesses. Row i is processed as if guesses[:i] were committed: the penalties count them and the
grammar has advanced over them. So when guesses[:i] are accepted, row i is exactly the row plain decoding would
have processed there, and acceptance against the processed rows keeps DFlash lossless. Bias and penalties are
computed for all rows at once on the device; grammar masks on the host, row after row (engine.grammar).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.grammar import GrammarMatcher, unpack_bitmask


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the target (log-softmax of its raw logits at that position), and
    the most likely tokens there with theirs (as many as the request's logprobs asked for)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogitProcessor:
    """Per request: the tokens so far (prompt and output), the counts the penalties read, the grammar's matcher.
    commit() must see every committed token, in order."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device,
                 grammar: GrammarMatcher | None = None):
        self.params, self.vocab_size, self.device = params, vocab_size, device
        self.grammar = grammar
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            ids = torch.tensor(list(params.logit_bias), device=device)
            self.bias[ids] = torch.tensor(list(params.logit_bias.values()), device=device)
        self.repeats = params.repeat_penalty != 1.0 and params.repeat_last_n != 0
        self.penalises_output = bool(params.presence_penalty or params.frequency_penalty)
        # Running counts: of every token (repeat penalty over the whole context), of the output's tokens.
        self.all_counts = self._counts(self.tokens) if self.repeats and params.repeat_last_n < 0 else None
        self.output_counts = torch.zeros(vocab_size, device=device) if self.penalises_output else None

    def _counts(self, tokens: list[int]) -> torch.Tensor:
        counts = torch.zeros(self.vocab_size, device=self.device)
        if tokens:
            ids = torch.tensor(tokens, device=self.device)
            counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        return counts

    def _guess_counts(self, guesses: list[int], rows: int) -> torch.Tensor:
        """[rows, V]: row i counts guesses[:i]."""
        counts = torch.zeros(rows, self.vocab_size, device=self.device)
        if rows > 1:
            ids = torch.tensor(guesses[:rows - 1], device=self.device)
            before = torch.arange(rows, device=self.device)[:, None] > torch.arange(rows - 1, device=self.device)
            counts.scatter_add_(1, ids.expand(rows, -1), before.float())
        return counts

    def _window_counts(self, guesses: list[int], rows: int, last_n: int) -> torch.Tensor:
        """[rows, V]: row i counts the last last_n tokens of tokens + guesses[:i]."""
        L = len(self.tokens)
        lo = max(0, L - last_n)
        span = self.tokens[lo:] + guesses[:rows - 1]
        where = lo + torch.arange(len(span), device=self.device)  # each span token's index in the sequence
        ends = L + torch.arange(rows, device=self.device)[:, None]  # row i's window ends before index L + i
        inside = (where < ends) & (where >= ends - last_n)
        ids = torch.tensor(span, device=self.device)
        return torch.zeros(rows, self.vocab_size, device=self.device).scatter_add_(
            1, ids.expand(rows, -1), inside.float())

    def process(self, logits: torch.Tensor, guesses: list[int]) -> torch.Tensor:
        """Rows [T, V] (T <= len(guesses) + 1) after the committed tokens and after each guesses[:i], processed
        (float32, a new tensor). The grammar's masks are filled on the host after the GPU work on `logits` is
        queued, so on a GPU they overlap it."""
        p = self.params
        rows = logits.shape[0]
        x = logits.float().clone()
        if self.bias is not None:
            x += self.bias
        if self.repeats:
            if p.repeat_last_n < 0:
                seen = self.all_counts + self._guess_counts(guesses, rows)
            else:
                seen = self._window_counts(guesses, rows, p.repeat_last_n)
            penalised = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty)
            x = torch.where(seen > 0, penalised, x)
        if self.penalises_output:
            counts = self.output_counts + self._guess_counts(guesses, rows)
            x -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
        if self.grammar is not None:
            masks = self.grammar.masks(guesses[:rows - 1])[:rows]
            if masks.shape[0]:
                allowed = unpack_bitmask(masks, self.vocab_size, x.device)
                x[:masks.shape[0]] = x[:masks.shape[0]].masked_fill(~allowed, float("-inf"))
        return x

    def commit(self, tokens: list[int]) -> None:
        """Tokens committed after the ones seen so far."""
        self.tokens.extend(tokens)
        if self.all_counts is not None:
            self.all_counts += self._counts(tokens)
        if self.output_counts is not None:
            self.output_counts += self._counts(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, count: int) -> list[TokenLogprob]:
        """Row t's token tokens[t]: its log-probability under the raw logits, and the row's `count` most likely
        tokens, best first. count: how many rows (leading) are wanted."""
        lp = torch.log_softmax(logits[:count].float(), dim=-1)
        chosen = lp.gather(1, tokens[:count, None])[:, 0].tolist()
        k = self.params.logprobs or 0
        if k:
            top = torch.topk(lp, k, dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        else:
            top_ids = top_lps = [[] for _ in range(count)]
        ids = tokens[:count].tolist()
        return [TokenLogprob(token=t, logprob=c, top=list(zip(i, v)))
                for t, c, i, v in zip(ids, chosen, top_ids, top_lps)]
