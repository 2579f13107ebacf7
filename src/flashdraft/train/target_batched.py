"""Batched passes of a frozen target, built from its own modules (the engine's target runs one sequence).

- `target_taps`: the tap features of whole right-padded sequences, for drafter training.
- `generate_batch`: batched decoding with a simple per-layer KV cache, for the training responses.
Both compute what DecoderLM.forward computes row by row; padding never reaches a real row.
"""
from __future__ import annotations

import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.speculative import sample_tokens
from flashdraft.models import DecoderLM

SYNC_EVERY = 16  # decoding steps between checks for an all-finished batch


def _layer(layer, h, cos, sin, mask, cached=None):
    """One decoder layer over h [b, T, hidden]. cached(k, v), if given, stores the rows' keys/values and
    returns all keys/values to attend to (cache included)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    k, v = attn.project_kv(x, cos, sin)
    if cached is not None:
        k, v = cached(k, v)
    h = h + attn.attend(attn.batched_q(x, cos, sin), k, v, mask)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.no_grad()
def target_taps(target: DecoderLM, tokens: torch.Tensor, tap_ids: list[int], final: bool = False):
    """Outputs of decoder layers tap_ids, concatenated in list order: tokens [b, S] -> [b, S, n_tap * hidden].
    With final=True, also the final-normed last hidden states [b, S, hidden] (the LM head's input), as a pair.

    Sequences sit at positions 0..len-1 and are right-padded, so a causal mask keeps pad rows out of
    every real row. Without final, layers above the highest tap are skipped.
    """
    S = tokens.shape[1]
    positions = torch.arange(S, device=tokens.device)
    cos, sin = target.rope(positions)
    mask = torch.ones(S, S, dtype=torch.bool, device=tokens.device).tril()
    h = target.embed(tokens)
    taps = {}
    layers = target.model.layers if final else target.model.layers[:max(tap_ids) + 1]
    for i, layer in enumerate(layers):
        h = _layer(layer, h, cos, sin, mask)
        taps[i] = h
    tapped = torch.cat([taps[i] for i in tap_ids], dim=-1)
    return (tapped, target.model.norm(h)) if final else tapped


@torch.no_grad()
def generate_batch(target: DecoderLM, prompts: list[list[int]], max_new_tokens: list[int], eos_ids: set[int],
                   params: SamplingParams, seeds: list[int]) -> list[list[int]]:
    """The target's own continuations of several prompts at once (each ends at its first EOS, which is kept).

    Prompts are left-padded to one width so every step writes the same cache column; each sequence keeps
    its own positions (column - padding), and its mask hides the padding columns. Sampling is the engine's:
    position-keyed with seeds[i], so a sequence's tokens do not depend on its batch mates.
    """
    device = target.model.norm.weight.device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + max(max_new_tokens)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    tokens = torch.zeros(b, width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.tensor(p, device=device)
    cfg = target.config
    shape = (b, cfg.num_key_value_heads, total, cfg.head_dim)
    dtype = target.model.norm.weight.dtype
    cache = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
             for _ in target.model.layers]
    columns = torch.arange(total, device=device)
    real = columns[None, :] >= pad[:, None]  # [b, total]: columns holding real tokens

    # Outputs stay on the device; finished rows are noted there and read back every SYNC_EVERY steps, so the
    # host does not wait on the device each step.
    steps = max(max_new_tokens)
    budget = torch.tensor(max_new_tokens, device=device)
    eos = torch.tensor(sorted(eos_ids), device=device, dtype=torch.long)
    out = torch.zeros(b, max(steps, 1), dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    finished = budget <= 0
    start = 0
    for step in range(steps):
        end = start + tokens.shape[1]
        step_cols = columns[start:end]
        # Finished rows keep stepping with their batch; their outputs are dropped, but their positions must stay
        # inside the RoPE table.
        positions = (step_cols[None, :] - pad[:, None]).clamp(min=0, max=target.rope.cos.shape[0] - 1)
        cos, sin = target.rope(positions)
        # Causal over real columns; a pad query row sees only itself (its output is never used).
        mask = (real[:, None, :end] & (columns[None, None, :end] <= step_cols[None, :, None])) | \
               (columns[None, None, :end] == step_cols[None, :, None])
        h = target.embed(tokens)
        for layer, (ck, cv) in zip(target.model.layers, cache):
            def cached(k, v, ck=ck, cv=cv):
                ck[:, :, start:end], cv[:, :, start:end] = k, v
                return ck[:, :, :end], cv[:, :, :end]
            h = _layer(layer, h, cos, sin, mask[:, None], cached)
        logits = target.logits(target.model.norm(h[:, -1]))
        next_positions = positions[:, -1] + 1
        if params.greedy:
            new = logits.argmax(dim=-1)
        else:
            new = torch.cat([sample_tokens(logits[i:i + 1], params, seeds[i], next_positions[i:i + 1])
                             for i in range(b)])
        out[:, step] = new
        lengths += ~finished
        finished = finished | torch.isin(new, eos) | (lengths >= budget)
        start, tokens = end, new[:, None]
        if (step + 1) % SYNC_EVERY == 0 and bool(finished.all()):
            break
    return [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]
