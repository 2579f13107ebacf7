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

import functools
import math
import os

import torch

from flashdraft.config import SamplingParams
from flashdraft.kernels.runtime import can_run, interpreting

_M32 = 0xFFFFFFFF
GUMBEL_BLOCK = 2048  # columns per program of the Gumbel-max kernel (the whole vocabulary: 75 programs a row)
TOP_K_TIES = 16  # candidates past the k-th that top-k keeps when they tie with it (bf16 logits tie often)


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


def gumbel_noise(key: int | torch.Tensor, positions: torch.Tensor, tokens: int | torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, float32, keyed by (seed, position, token id); key: the seed, or its seed_key tensor
    (the same noise). tokens: the vocabulary size (noise [T, vocab] for every id) or the ids themselves [T, C]
    (the same values at those ids)."""
    k1, k2 = (key[0], key[1]) if isinstance(key, torch.Tensor) else _seed_keys(key)
    pos_key = _mix32(((positions.long() * 0x9E3779B1) ^ k1) & _M32)[:, None]
    if isinstance(tokens, int):
        tokens = torch.arange(tokens, device=positions.device, dtype=torch.int64)[None, :]
    x = _mix32(_mix32(tokens ^ k2) ^ pos_key)
    x = _mix32(x ^ ((pos_key * 0x27D4EB2F) & _M32))
    return gumbel_from_bits(x)


def gumbel_from_bits(x: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from 32-bit hash values: the top 24 bits as a uniform in (0, 1). In float32 the highest value,
    (2**24 - 0.5) / 2**24, rounds to 1, whose noise is +inf: a token removed by warping or a grammar (-inf)
    would then sample as NaN, which argmax picks. It is clamped to the float just below 1."""
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u.clamp(max=1.0 - 2.0 ** -24)))


def warped_candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, top-p, min-p: the log-probabilities of the tokens left, with their ids ([T, C]
    each, removed tokens at -inf), or of the whole vocabulary ([T, V], ids None). With top-k the candidates come
    sorted from one top-k selection, so top-p needs no sort of the vocabulary and the rest of sampling works on
    about k columns instead of V (docs/performance.md, "Sampling on the candidates"). Top-k keeps the tokens tied
    with the k-th (as transformers and vLLM do), up to TOP_K_TIES of them."""
    ids, vocab = None, logits.shape[-1]
    if 0 < params.top_k < vocab:  # the k best logits are the k best log-probabilities
        x, ids = torch.topk(logits, min(params.top_k + TOP_K_TIES, vocab), dim=-1)
        x = x.float() / params.temperature
        x = torch.log_softmax(x.masked_fill(x < x[:, params.top_k - 1:params.top_k], float("-inf")), dim=-1)
    else:
        x = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        if ids is None:
            x, ids = torch.sort(x, dim=-1, descending=True)
        probs = x.exp()
        # Keep the smallest prefix whose mass reaches top_p (a token goes if the mass before it already does),
        # and the tokens tied with its last: which of equal values sorts first must not decide.
        beyond = (probs.cumsum(-1) - probs) >= params.top_p
        last_kept = x.masked_fill(beyond, float("inf")).min(dim=-1, keepdim=True).values
        x = torch.log_softmax(x.masked_fill(x < last_kept, float("-inf")), dim=-1)
    if params.min_p > 0.0:
        threshold = x.max(dim=-1, keepdim=True).values + math.log(params.min_p)
        x = torch.log_softmax(x.masked_fill(x < threshold, float("-inf")), dim=-1)
    return x, ids


def sample_tokens(logits: torch.Tensor, params: SamplingParams, key: int | torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [T, V]; row t is the token at absolute position positions[t]. key: the seed or
    its seed_key tensor. No host syncs: a CUDA graph can capture it."""
    if params.greedy:
        return logits.argmax(dim=-1)
    x, ids = warped_candidates(logits, params)
    return gumbel_max(x, ids, key, positions)


def gumbel_max(x: torch.Tensor, ids: torch.Tensor | None, key: int | torch.Tensor, positions: torch.Tensor,
               kernel: bool | None = None) -> torch.Tensor:
    """The token of each row of warped log-probabilities x [T, C] (token ids `ids` [T, C], or the column when
    None) that has the largest x + gumbel_noise. kernel: one Triton kernel (gumbel_triton, the default where it
    runs on a GPU) or the torch ops that define it."""
    if kernel is None:
        kernel = x.is_cuda and can_run(x.device)
    if not kernel:
        choice = (x + gumbel_noise(key, positions, x.shape[-1] if ids is None else ids)).argmax(dim=-1)
        return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]
    if not isinstance(key, torch.Tensor):
        key = seed_key(key, x.device)
    T, C = x.shape
    block = min(GUMBEL_BLOCK, max(16, 1 << (C - 1).bit_length()))
    blocks = -(-C // block)
    best_x = torch.empty(T, blocks, device=x.device, dtype=torch.float32)
    best_id = torch.empty(T, blocks, device=x.device, dtype=torch.int64)
    x = x.contiguous()
    ids = ids.contiguous() if ids is not None else None
    _kernels().gumbel_max_kernel[(blocks, T)](
        x, ids if ids is not None else best_id, positions.contiguous(), key, best_x, best_id, C, x.stride(0),
        ids.stride(0) if ids is not None else 0, HAS_IDS=ids is not None, BLOCK=block, LIBDEVICE=not interpreting())
    if blocks == 1:
        return best_id[:, 0]
    return best_id.gather(-1, best_x.argmax(dim=-1, keepdim=True))[:, 0]


@functools.cache
def _kernels():
    from flashdraft.kernels import gumbel_triton
    return gumbel_triton


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one (reported back so the run can be repeated)."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
