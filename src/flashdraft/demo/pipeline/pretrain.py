"""Stage 3, target: a Qwen3 code model trained from scratch on the token streams, saved in HF layout.

transformers' Qwen3ForCausalLM is used for this training step only (SDPA attention, no cache); the saved
folder is what flashdraft's own model code loads. Batches are random windows of the train stream (fixed
seed). The schedule runs until --steps or --max-minutes, whichever comes first: the learning rate follows a
warmup then a cosine over progress = max(step / steps, elapsed / budget), so a slower machine still anneals.
Held-out loss is logged every --eval-every steps and at the end.

    python -m flashdraft.demo.pipeline.pretrain --tokenizer runs/demo/tokenizer --out runs/demo/target \\
        --hidden 384 --layers 8 --heads 6 --kv-heads 2 --intermediate 1024 --max-minutes 4
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from flashdraft.demo.pipeline.bpe import ENDOFTEXT, IM_END

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_stream(path: Path, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int32)).to(device)


def model_config(args, vocab_size: int, special: dict):
    import transformers

    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--hidden ({args.hidden}) must divide by --heads ({args.heads}) and --heads by "
                         f"--kv-heads ({args.kv_heads})")
    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.seq_len, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02, attn_implementation="sdpa",
        eos_token_id=special[IM_END], pad_token_id=special[ENDOFTEXT], bos_token_id=None)


def windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows stream[s : s + seq_len + 1] as int64 (inputs are [:, :-1], labels [:, 1:])."""
    offsets = torch.arange(seq_len + 1, device=stream.device)
    return stream[starts.to(stream.device)[:, None] + offsets].long()


def lm_loss(model, rows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int, batch: int, autocast: bool) -> float:
    """Mean loss over the first non-overlapping windows of the held-out stream (the same ones every time)."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
    starts = torch.arange(n) * seq_len
    model.eval()
    total = 0.0
    for i in range(0, n, batch):
        part = starts[i:i + batch]
        total += lm_loss(model, windows(stream, part, seq_len), autocast).item() * part.numel()
    model.train()
    return total / n


def learning_rate(args, step: int, progress: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_target(model, tokenizer_dir: Path, out: Path, special: dict) -> None:
    """bf16 safetensors, HF config, generation_config (both end tokens stop) and the tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [special[IM_END], special[ENDOFTEXT]]
    model.generation_config.pad_token_id = special[ENDOFTEXT]
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)


def train(args) -> dict:
    import transformers

    t0 = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast = device.type == "cuda"
    meta = json.loads((args.tokenizer / "tokens" / "meta.json").read_text())
    special = meta["special_ids"]
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_stream = load_stream(args.tokenizer / "tokens" / "train.bin", device)
    held_stream = load_stream(args.tokenizer / "tokens" / "heldout.bin", device)
    if train_stream.numel() <= args.seq_len + 1:
        raise ValueError(f"train stream has {train_stream.numel()} tokens, fewer than one window of {args.seq_len + 1}")
    cfg = model_config(args, meta["vocab_size"], special)
    model = transformers.Qwen3ForCausalLM(cfg).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    step_fn = torch.compile(model) if args.compile else model
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
    log = args.log.open("a") if args.log else None

    def report(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    report({"event": "start", "params": params, "device": str(device), "train_tokens": train_stream.numel(),
            "heldout_tokens": held_stream.numel(), "tokens_per_step": args.batch_size * args.seq_len})
    budget = args.max_minutes * 60
    start = time.monotonic()
    step, running, running_n, train_loss = 0, torch.zeros((), device=device), 0, float("nan")
    while step < args.steps:
        elapsed = time.monotonic() - start
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1:
            break
        lr = learning_rate(args, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
        loss = lm_loss(step_fn, windows(train_stream, starts, args.seq_len), autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running += loss.detach()  # summed on the device: no host sync until the next log line
        running_n += 1
        if step % args.log_every == 0 or step == 1:
            elapsed = time.monotonic() - start
            train_loss = running.item() / running_n
            if not math.isfinite(train_loss):
                raise ValueError(f"training loss became {train_loss} by step {step}; lower --lr")
            record = {"step": step, "train_loss": round(train_loss, 4), "lr": lr, "elapsed_s": round(elapsed, 1),
                      "tokens_per_s": round(step * args.batch_size * args.seq_len / elapsed)}
            if step % args.eval_every == 0:
                record["heldout_loss"] = round(held_out_loss(model, held_stream, args.seq_len, args.eval_windows,
                                                             args.batch_size, autocast), 4)
            report(record)
            running, running_n = torch.zeros((), device=device), 0
    train_seconds = time.monotonic() - start
    final = held_out_loss(model, held_stream, args.seq_len, args.eval_windows, args.batch_size, autocast)
    save_target(model, args.tokenizer, args.out, special)
    summary = {"event": "done", "params": params, "steps": step, "tokens_seen": step * args.batch_size * args.seq_len,
               "train_seconds": round(train_seconds, 1), "final_train_loss": round(train_loss, 4),
               "final_heldout_loss": round(final, 4), "seconds": round(time.monotonic() - t0, 1),
               "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "max_position_embeddings")}}
    report(summary)
    if log:
        log.close()
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="folder written by the tokenizer stage")
    p.add_argument("--out", type=Path, required=True, help="output model folder")
    p.add_argument("--log", type=Path, default=None, help="append JSON log lines here")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=4096, help="training window = the model's context (default 4096)")
    p.add_argument("--batch-size", type=int, default=32, help="windows per step (default 32)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=100_000, help="step cap (default: the time budget decides)")
    p.add_argument("--max-minutes", type=float, default=4.0, help="training wall-clock budget (default 4)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200, help="held-out loss every N steps (a multiple of --log-every)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per evaluation")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.seq_len, args.batch_size,
           args.steps, args.warmup, args.log_every, args.eval_every) < 1 or args.max_minutes <= 0:
        p.error("sizes, steps, --warmup, --log-every, --eval-every must be >= 1 and --max-minutes > 0")
    try:
        train(args)
    except (ValueError, OSError) as e:
        print(f"target: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
