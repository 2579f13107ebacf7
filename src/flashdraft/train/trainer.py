"""Drafter training (the published DFlash recipe) over a frozen target, start to finish.

prompts -> target responses (cached) -> steps of: target taps over whole sequences, random anchors re-sampled
every step, all blocks of a batch in one drafter pass under the training mask, decayed per-slot cross-entropy
-> z-lab-layout drafter folder -> held-out tau with the engine's real decoding loop -> train_report.json.
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.config import ModelConfig, SamplingParams
from flashdraft.loading import Tokenizer
from flashdraft.models import load_target
from flashdraft.loading.checkpoint import default_device_dtype, model_folder
from flashdraft.train.blocks import block_loss, default_gamma, make_blocks, sample_anchors, slot_weights
from flashdraft.train.data import (ResponseCache, TrainSequence, collate, encode_prompts, generate_responses,
                                   generation_meta, load_prompts, split_held_out, training_sequences)
from flashdraft.train.drafter_setup import (check_compatible, init_drafter, make_drafter_config,
                                            resolve_mask_token, save_drafter)
from flashdraft.train.evaluate import measure_tau
from flashdraft.train.target_batched import target_taps

CHECKPOINT = "checkpoint.pt"
REPORT = "train_report.json"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    target: str
    prompts: str
    out: str
    block_size: int = 16
    layers: int = 5
    tap_ids: list[int] | None = None
    mask_token_id: int | None = None
    steps: int = 1000
    max_minutes: float | None = None  # training wall-clock budget: the schedule ends at steps or here, first
    lr: float = 6e-4
    warmup: float = 0.04              # fraction of steps with linear warmup, then cosine to 0
    weight_decay: float = 0.0
    batch_size: int = 8               # sequences per step
    anchors: int = 128                # blocks per sequence per step (at most)
    gamma: float | None = None        # slot-weight decay; default 7 for B=16 (default_gamma)
    loss: str = "ce"                  # "ce": the target's greedy tokens; "kd": the target's distributions
    max_new_tokens: int = 512         # response length the target may write
    max_seq_len: int | None = None    # prompt + response tokens trained on (default: all)
    temperature: float = 0.0          # the target's sampling temperature for responses (0 = greedy)
    chat: bool = False                # wrap "prompt" strings as a user message in the chat template
    gen_batch_size: int = 64
    gen_max_minutes: float | None = None  # response generation budget: train on the responses made by then
                                          # (0: only the responses already in the data folder)
    data_dir: str | None = None       # response cache folder (default OUT/data)
    generate_only: bool = False       # write the responses to the data folder and stop (no drafter)
    eval_prompts: int | None = None   # held-out prompts (default: 10% of the prompts, at most 16)
    eval_file: str | None = None      # held-out prompts from another file instead of a split
    eval_max_tokens: int | None = None
    seed: int = 0
    resume: bool = False
    device: str | None = None
    save_every: int = 500
    log_every: int = 10
    save_dtype: str = "bfloat16"
    progress: bool = True

    def validate(self) -> None:
        checks = [("steps", self.steps >= 1), ("lr", self.lr > 0), ("batch_size", self.batch_size >= 1),
                  ("anchors", self.anchors >= 1), ("max_new_tokens", self.max_new_tokens >= 2),
                  ("gen_batch_size", self.gen_batch_size >= 1), ("warmup", 0 <= self.warmup < 1),
                  ("weight_decay", self.weight_decay >= 0), ("temperature", self.temperature >= 0),
                  ("save_every", self.save_every >= 1), ("log_every", self.log_every >= 1),
                  ("gamma", self.gamma is None or self.gamma > 0),
                  ("max_seq_len", self.max_seq_len is None or self.max_seq_len >= 3),
                  ("eval_prompts", self.eval_prompts is None or self.eval_prompts >= 0),
                  ("max_minutes", self.max_minutes is None or self.max_minutes > 0),
                  ("gen_max_minutes", self.gen_max_minutes is None or self.gen_max_minutes >= 0),
                  ("loss", self.loss in ("ce", "kd")),
                  ("eval_max_tokens", self.eval_max_tokens is None or self.eval_max_tokens >= 2),
                  ("save_dtype", self.save_dtype in ("bfloat16", "float16", "float32"))]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise ValueError(f"invalid value for {', '.join(bad)}: " +
                             ", ".join(f"{n}={getattr(self, n)!r}" for n in bad))


@dataclass
class Sampler:
    """Shuffled passes over the training sequences and the anchor draws, from one seeded generator whose
    state the checkpoint keeps (so a resumed run continues the same stream).

    With lengths, each pass is cut into groups of LENGTH_GROUP batches whose sequences are sorted by length
    before they are dealt out, so a batch pads its short sequences to a similar length rather than to the
    longest prompt in the data (a few 4K-token prompts among short ones otherwise make every step cost as much
    as an all-4K batch)."""

    n: int
    generator: torch.Generator
    lengths: list[int] | None = None
    order: list[int] = field(default_factory=list)

    LENGTH_GROUP = 16

    def batch(self, size: int) -> list[int]:
        out = []
        while len(out) < size:
            if not self.order:
                self.order = self._pass(size)
            out.append(self.order.pop())
        return out

    def _pass(self, size: int) -> list[int]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        if self.lengths is None:
            return order
        grouped = []
        span = size * self.LENGTH_GROUP
        for g in range(0, self.n, span):
            group = sorted(order[g:g + span], key=lambda i: self.lengths[i])
            batches = [group[k:k + size] for k in range(0, len(group), size)]
            for b in torch.randperm(len(batches), generator=self.generator).tolist():
                grouped.extend(batches[b])
        return grouped

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.order = list(state["order"])


class StopRequest:
    """While active, a first SIGINT (Ctrl-C, or `timeout -s INT`) only sets `requested`, so the training loop
    can stop at a step boundary with its checkpoint and the drafter saved; a second one interrupts at once."""

    def __init__(self):
        self.requested, self._previous = False, None

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None and not self.requested:
            signal.signal(signal.SIGINT, self._previous)


def lr_factor(progress: float, warmup: float, steps: int) -> float:
    """Linear warmup over the first `warmup` of training, then a cosine to 0. progress in [0, 1] is the larger
    of step / steps and elapsed / time budget, so a run cut short by its budget still anneals."""
    if progress < warmup:
        return max(progress / warmup, 1 / max(1, round(warmup * steps)))
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


class SlotStats:
    """Running per-slot accuracy and the in-training acceptance length (1 + leading correct slots per block)."""

    def __init__(self, slots: int):
        self.correct, self.count = torch.zeros(slots), torch.zeros(slots)
        self.run, self.blocks, self.loss, self.steps = 0.0, 0, 0.0, 0

    def add(self, loss: float, correct: torch.Tensor, label_mask: torch.Tensor) -> None:
        """correct/label_mask [b, A, B-1] (correct only where counted)."""
        self.correct += correct.sum((0, 1)).float().cpu()
        self.count += label_mask.sum((0, 1)).float().cpu()
        blocks = label_mask[:, :, 0]
        self.run += float(torch.cumprod(correct.long(), dim=2).sum(2)[blocks].sum())
        self.blocks += int(blocks.sum())
        self.loss += loss
        self.steps += 1

    def summary(self) -> dict:
        acc = (self.correct / self.count.clamp(min=1)).tolist()
        return {"loss": self.loss / max(1, self.steps), "slot_acc": [round(a, 4) for a in acc],
                "train_tau": 1 + self.run / max(1, self.blocks)}


def train_drafter(cfg: TrainConfig) -> dict:
    """Run the whole pipeline; returns the report also written to OUT/train_report.json."""
    cfg.validate()
    # cuDNN's SDPA rejects the block-sparse boolean training mask on the H200 (mha_graph.execute fails);
    # the other fused backends take it.
    torch.backends.cuda.enable_cudnn_sdp(False)
    started = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.is_file() and not cfg.resume:
        raise ValueError(f"{ckpt_path} exists from an earlier run: pass --resume to continue it, or choose "
                         f"another --out")
    try:
        device, target_dtype = default_device_dtype(cfg.device, None)
    except RuntimeError as e:
        raise ValueError(f"--device {cfg.device!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    target_dir = model_folder(cfg.target, "target")
    tcfg = ModelConfig.from_file(target_dir / "config.json")
    tokenizer = Tokenizer(target_dir)
    target = load_target(target_dir, tcfg.max_position_embeddings + cfg.block_size, device, target_dtype)
    eos_ids = set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})

    mask_id = resolve_mask_token(tokenizer, target.config, cfg.mask_token_id)
    dcfg = make_drafter_config(tcfg, cfg.layers, cfg.block_size, mask_id, cfg.tap_ids)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    say = print if cfg.progress else (lambda *a, **k: None)
    say(f"target {target_dir} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}) on {device}; drafter: "
        f"{cfg.layers} layers, block {cfg.block_size}, taps {dcfg.target_layer_ids}, mask token {mask_id}")

    # Data: prompts, held-out split, the target's own responses.
    prompt_ids = encode_prompts(load_prompts(cfg.prompts), tokenizer, cfg.chat)
    if cfg.eval_file:
        train_idx, eval_ids = list(range(len(prompt_ids))), encode_prompts(load_prompts(cfg.eval_file), tokenizer,
                                                                           cfg.chat)
    else:
        n = len(prompt_ids)
        n_eval = cfg.eval_prompts if cfg.eval_prompts is not None else (min(16, n // 10) if n >= 10 else int(n >= 2))
        train_idx, eval_idx = split_held_out(n, n_eval, cfg.seed)
        eval_ids = [prompt_ids[i] for i in eval_idx]
    gen_params = SamplingParams(temperature=cfg.temperature)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out / "data"
    cache = ResponseCache(data_dir, generation_meta(target_dir, prompt_ids, cfg.max_new_tokens, gen_params,
                                                    cfg.seed))
    t0 = time.time()
    responses = generate_responses(target, prompt_ids, train_idx, cache, cfg.max_new_tokens, eos_ids, gen_params,
                                   cfg.seed, cfg.gen_batch_size, tcfg.max_position_embeddings, cfg.progress,
                                   cfg.gen_max_minutes * 60 if cfg.gen_max_minutes is not None else None)
    gen_seconds = time.time() - t0
    if cfg.generate_only:
        say(f"{len(responses)} responses for {len(train_idx)} prompts in {data_dir} ({gen_seconds:.0f} s)")
        return {"target": str(target_dir), "data_dir": str(data_dir), "training_prompts": len(train_idx),
                "responses": len(responses), "generation_seconds": round(gen_seconds, 1)}
    if not responses:
        raise ValueError(f"no responses in {data_dir} and no generation budget (--gen-max-minutes 0 trains on the "
                         f"responses a run with the same prompts and settings already wrote there)")
    if len(responses) < len(train_idx):
        say(f"responses for {len(responses)} of {len(train_idx)} training prompts within the generation budget")
    max_seq_len = min(cfg.max_seq_len or tcfg.max_position_embeddings, tcfg.max_position_embeddings)
    seqs = training_sequences(prompt_ids, responses, max_seq_len)
    response_tokens = sum(len(s.tokens) - s.prompt_len for s in seqs)
    say(f"{len(seqs)} training sequences ({response_tokens} response tokens), {len(eval_ids)} held-out prompts")

    drafter = init_drafter(dcfg, max_seq_len + cfg.block_size, cfg.seed).to(device).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = Sampler(len(seqs), torch.Generator().manual_seed(cfg.seed), [len(q.tokens) for q in seqs])
    step, trained_seconds = 0, 0.0  # trained_seconds: optimisation time of earlier runs of a resumed training
    budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)  # rng state must stay on cpu
        check_compatible(dcfg, state["drafter_config"], str(ckpt_path))
        if state["sequences"] != len(seqs):
            raise ValueError(f"{ckpt_path} was trained on {state['sequences']} sequences, this data has {len(seqs)}; "
                             f"resume with the same prompts and data settings")
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        step, trained_seconds = state["step"], state.get("train_seconds", 0.0)
        say(f"resumed from {ckpt_path} at step {step}")

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"drafter_config": dcfg.to_dict(), "model": drafter.state_dict(), "step": step,
                    "optimizer": optimizer.state_dict(), "train_seconds": trained_seconds + time.time() - t0,
                    "sampler": sampler.state_dict(), "sequences": len(seqs), "train_config": asdict(cfg)}, tmp)
        os.replace(tmp, ckpt_path)

    weights = slot_weights(cfg.block_size, gamma)
    pad_id = mask_id
    window, last_window, first_loss = SlotStats(cfg.block_size - 1), None, None
    t0 = time.time()
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", disable=not cfg.progress)

    def progress() -> float:
        return max(step / cfg.steps, (trained_seconds + time.time() - t0) / budget)

    with (out / LOG).open("a") as log, StopRequest() as stop:
        p = progress()
        while p < 1:
            if stop.requested:
                save_checkpoint()
                save_drafter(drafter.eval(), out, getattr(torch, cfg.save_dtype))
                raise KeyboardInterrupt(f"stopped at step {step}")
            lr = cfg.lr * lr_factor(p, cfg.warmup, cfg.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = [seqs[i] for i in sampler.batch(cfg.batch_size)]
            loss, correct, label_mask = train_step(target, drafter, batch, sampler.generator, cfg.anchors,
                                                   dcfg, weights, pad_id, device, distill=cfg.loss == "kd")
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss became {loss.item()} at step {step}; lower --lr")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            p = progress()  # once: the step that ends the loop is the one logged and saved as the last
            last = p >= 1
            first_loss = first_loss if first_loss is not None else loss.item()
            window.add(loss.item(), correct, label_mask)
            if step % cfg.log_every == 0 or last:
                s = window.summary()
                log.write(json.dumps({"step": step, "lr": lr, **s}) + "\n")
                log.flush()
                # Per-slot accuracy in percent, slot 1 first.
                bar.set_postfix_str(f"loss {s['loss']:.3f} tau {s['train_tau']:.2f} acc% "
                                    + ",".join(str(round(100 * a)) for a in s["slot_acc"]))
                last_window = s
                window = SlotStats(cfg.block_size - 1)
            if step % cfg.save_every == 0 or last:
                save_checkpoint()
            bar.update(1)
    bar.close()
    train_seconds = time.time() - t0

    drafter.eval()
    save_drafter(drafter, out, getattr(torch, cfg.save_dtype))
    report = {"target": str(target_dir), "drafter": str(out), "drafter_config": dcfg.to_dict(),
              "train_config": asdict(cfg), "gamma": gamma, "training_prompts": len(train_idx),
              "responses": len(responses), "sequences": len(seqs),
              "response_tokens": response_tokens, "generation_seconds": round(gen_seconds, 1),
              "train_seconds": round(train_seconds, 1), "steps": step, "first_loss": first_loss,
              "final": last_window}
    eval_max = cfg.eval_max_tokens or cfg.max_new_tokens
    report["held_out"] = None
    if not eval_ids:
        say("held-out tau skipped: no held-out prompts (give more prompts, --eval-prompts N or --eval-file)")
    else:
        try:
            h = report["held_out"] = measure_tau(target_dir, out, eval_ids, eval_max, device, cfg.progress)
            say(f"held-out tau {h['tau']:.2f} (pooled {h['tau_pooled']:.2f}, acceptance {h['acceptance_rate']:.1%}) "
                f"on {h['prompts']} prompts, greedy, {eval_max} tokens, block {cfg.block_size}")
        except ValueError as e:  # the drafter is saved; say why tau is missing instead of failing the run
            report["held_out_error"] = str(e)
            say(f"held-out tau not measured: {e}")
    report["total_seconds"] = round(time.time() - started, 1)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    say(f"drafter saved to {out} ({REPORT} has the numbers)")
    return report


def train_step(target, drafter, batch: list[TrainSequence], generator: torch.Generator, n_anchors: int, dcfg,
               weights: torch.Tensor, pad_id: int, device: torch.device, distill: bool = False):
    """Loss of one batch (not yet backpropagated), plus per-slot correctness and counted-label mask [b, A, B-1].
    distill: the loss is against the target's distribution at each label (its logits one position before)."""
    B = dcfg.block_size
    tokens, loss_mask, lengths = collate(batch, pad_id)
    anchors, valid = sample_anchors(loss_mask, lengths, n_anchors, generator)
    tokens, loss_mask, anchors, valid = (t.to(device) for t in (tokens, loss_mask, anchors, valid))
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        if distill:
            taps, final = target_taps(target, tokens, dcfg.target_layer_ids, final=True)
        else:
            taps = target_taps(target, tokens, dcfg.target_layer_ids)
        blocks = make_blocks(tokens, loss_mask, anchors, valid, B, dcfg.mask_token_id)
        hidden = drafter.forward_train(target.embed(blocks.tokens), blocks.positions, taps, blocks.mask)
        b, A = anchors.shape
        hidden = hidden.view(b, A, B, -1)[:, :, 1:]
        counted = blocks.label_mask
        slots = torch.arange(B - 1, device=device).expand_as(counted)[counted]
        teacher = None
        if distill:  # label k of anchor a is token a+k, which the target predicted at position a+k-1
            before = (anchors[:, :, None] + torch.arange(B - 1, device=device)).clamp(max=tokens.shape[1] - 1)
            rows = final.gather(1, before.flatten(1)[:, :, None].expand(-1, -1, final.shape[-1]))
            teacher = target.logits(rows.view(b, A, B - 1, -1)[counted])
        loss, hits = block_loss(target.logits(hidden[counted]), blocks.labels[counted], slots, weights, teacher)
    correct = torch.zeros_like(counted)
    correct[counted] = hits
    return loss, correct, counted
