"""Training blocks of the DFlash recipe: random anchors, masked blocks, the training mask and the loss.

A block for anchor a is [token[a], MASK x (B-1)] at positions a..a+B-1, exactly what the decoding loop feeds
the drafter when token[a] is the last committed token. Slot k (1..B-1) predicts token[a+k] (same position,
not next token). Block j sees the context strictly before its anchor (the anchor's own target state does not
exist yet at inference) and its own block bidirectionally, nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def default_gamma(block_size: int) -> float:
    """The recipe's loss decay: 7 for B=16, 5 for B=10, 4 for B=8; in between, proportional to B."""
    return {8: 4.0, 10: 5.0, 16: 7.0}.get(block_size, block_size * 7 / 16)


@dataclass
class Blocks:
    tokens: torch.Tensor      # [b, A*B] block tokens: the anchor's token, then mask tokens
    positions: torch.Tensor   # [b, A*B] absolute positions anchor..anchor+B-1
    mask: torch.Tensor        # [b, A*B, S + A*B] True = may attend, over keys [context | blocks]
    labels: torch.Tensor      # [b, A, B-1] token[anchor+k] for slots k = 1..B-1
    label_mask: torch.Tensor  # [b, A, B-1] which labels count (a real anchor, in range, a response token)


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, n_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n_anchors distinct anchors per sequence, sorted: response positions with at least one label after
    them (a <= len-2). Returns anchors [b, A] and valid [b, A] (padding anchors are 0 and invalid)."""
    S = loss_mask.shape[1]
    candidates = loss_mask.clone()
    candidates &= torch.arange(S)[None, :] <= (lengths[:, None] - 2)
    chosen = []
    for row in candidates:
        pos = row.nonzero().flatten()
        pick = torch.randperm(pos.numel(), generator=generator)[:n_anchors]
        chosen.append(pos[pick].sort().values)
    A = max(1, max(c.numel() for c in chosen))
    anchors = torch.zeros(len(chosen), A, dtype=torch.long)
    valid = torch.zeros(len(chosen), A, dtype=torch.bool)
    for i, c in enumerate(chosen):
        anchors[i, :c.numel()], valid[i, :c.numel()] = c, True
    return anchors, valid


def make_blocks(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                block_size: int, mask_token_id: int) -> Blocks:
    """Blocks, training mask and labels for anchors [b, A] into right-padded tokens/loss_mask [b, S]."""
    b, S = tokens.shape
    A, B = anchors.shape[1], block_size
    dev = tokens.device
    slot = torch.arange(B, device=dev)
    positions = anchors[:, :, None] + slot  # [b, A, B]
    block_tokens = torch.full((b, A, B), mask_token_id, dtype=tokens.dtype, device=dev)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    label_pos = positions[:, :, 1:]
    in_range = label_pos < S
    label_pos = label_pos.clamp(max=S - 1)
    labels = tokens.gather(1, label_pos.flatten(1)).view(b, A, B - 1)
    label_mask = valid[:, :, None] & in_range & loss_mask.gather(1, label_pos.flatten(1)).view(b, A, B - 1)

    see_context = torch.arange(S, device=dev)[None, None, :] < anchors[:, :, None]  # [b, A, S]: strictly before
    see_context = see_context.repeat_interleave(B, dim=1)                             # [b, A*B, S]
    block_of = torch.arange(A * B, device=dev) // B
    see_block = (block_of[:, None] == block_of[None, :]).expand(b, A * B, A * B)
    mask = torch.cat([see_context, see_block], dim=2)
    return Blocks(tokens=block_tokens.flatten(1), positions=positions.flatten(1), mask=mask,
                  labels=labels, label_mask=label_mask)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1: early slots matter most (a miss ends the accepted run)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
               teacher_logits: torch.Tensor | None = None):
    """Weighted cross-entropy over the counted slots, normalised by the weight sum.

    logits [N, V] float32, labels [N], slots [N] (0-based slot index k-1). With teacher_logits [N, V] (the
    target's own logits for each label's position), the cross-entropy is against the target's distribution
    instead of its greedy token (knowledge distillation: every slot also learns what the target found nearly as
    likely). Returns (loss, correct [N]); correct always compares with the labels."""
    if teacher_logits is None:
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    else:
        teacher = torch.softmax(teacher_logits.float(), dim=-1)
        ce = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)
    w = weights.to(logits.device)[slots]
    loss = (w * ce).sum() / w.sum().clamp(min=math.ulp(1.0))
    return loss, logits.argmax(dim=-1) == labels
