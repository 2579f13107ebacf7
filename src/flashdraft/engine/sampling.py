"""Logit warping and position-keyed sampling.

Sampling is Gumbel-max over the warped log-probabilities, with the noise a pure function of
(seed, absolute position, token id) computed by an integer hash on the device. Two consequences:
- the token at a position depends only on the logits there and the seed, never on how many tokens were
  sampled before or in which pass, so with the same seed DFlash and plain decoding emit the same text;
- there is no generator state to carry or sync, so a step can be captured in a CUDA graph.

Acceptance is exact match between the drafter's greedy proposal and the target's sample at each slot,
cut at the first mismatch. Every committed token is thus the target's own sample given the committed
prefix: the output follows the target's warped distribution exactly (this is speculative sampling with
a one-hot draft distribution, whose acceptance probability p(x) equals the chance of a match).
"""
from __future__ import annotations

import os

import torch

from flashdraft.config import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (bijective, good avalanche) on int64 tensors holding values < 2**32."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _seed_keys(seed: int) -> tuple[int, int]:
    # splitmix64 of the seed, split into two 32-bit keys.
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & _M32, z >> 32


def seed_key(seed: int, device: torch.device | str) -> torch.Tensor:
    """The seed as the noise reads it: its two 32-bit keys, [2] int64 on the device. A captured step reads the key
    from this tensor, so one graph serves every seed."""
    return torch.tensor(_seed_keys(seed), dtype=torch.int64, device=device)


def gumbel_noise(key: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [T, vocab], float32, keyed by (seed, position, token id); key: the seed, or its
    seed_key tensor (the same noise)."""
    k1, k2 = (key[0], key[1]) if isinstance(key, torch.Tensor) else _seed_keys(key)
    pos_key = _mix32(((positions.long() * 0x9E3779B1) ^ k1) & _M32)[:, None]
    ids = torch.arange(vocab, device=positions.device, dtype=torch.int64)[None, :]
    x = _mix32(_mix32(ids ^ k2) ^ pos_key)
    x = _mix32(x ^ ((pos_key * 0x27D4EB2F) & _M32))
    return gumbel_from_bits(x)


def gumbel_from_bits(x: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from 32-bit hash values: the top 24 bits as a uniform in (0, 1). In float32 the highest value,
    (2**24 - 0.5) / 2**24, rounds to 1, whose noise is +inf: a token removed by warping or a grammar (-inf)
    would then sample as NaN, which argmax picks. It is clamped to the float just below 1."""
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u.clamp(max=1.0 - 2.0 ** -24)))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p; removed tokens get -inf. Returns log-probabilities [T, V]."""
    x = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = torch.log_softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.exp()
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.log_softmax(x.masked_fill(drop, float("-inf")), dim=-1)
    if params.min_p > 0.0:
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(params.min_p))
        x = torch.log_softmax(x.masked_fill(x < threshold, float("-inf")), dim=-1)
    return x


def sample_tokens(logits: torch.Tensor, params: SamplingParams, key: int | torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [T, V]; row t is the token at absolute position positions[t]. key: the seed or
    its seed_key tensor. No host syncs: a CUDA graph can capture it."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logprobs = warp_logits(logits, params)
    return (logprobs + gumbel_noise(key, positions, logits.shape[-1])).argmax(dim=-1)


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one (reported back so the run can be repeated)."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
