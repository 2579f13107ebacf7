"""`flashdraft train-drafter`: train a DFlash drafter for a target model folder."""
from __future__ import annotations

import argparse
import sys

from flashdraft.train.trainer import TrainConfig, train_drafter


def _tap_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer ids like 1,3 or '1 3', got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--tap-ids needs at least one layer id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig
    p = argparse.ArgumentParser(
        prog="flashdraft train-drafter",
        description="Train a DFlash drafter on the target's own responses to your prompts (the published "
                    "recipe), save it in z-lab's layout and measure its held-out tau with the real decoding loop.")
    p.add_argument("--target", required=True,
                   help="target model folder (HF layout: config.json, safetensors, tokenizer)")
    p.add_argument("--prompts", required=True,
                   help='prompt file: .jsonl with {"prompt": ...} or {"messages": [...]} per line, '
                        'else one prompt per line')
    p.add_argument("--out", required=True, help="output drafter folder (also holds checkpoint, logs, response cache)")
    g = p.add_argument_group("drafter")
    g.add_argument("--block-size", type=int, default=d.block_size, help=f"block size B (default {d.block_size})")
    g.add_argument("--layers", type=int, default=d.layers, help=f"drafter layers (default {d.layers})")
    g.add_argument("--tap-ids", type=_tap_ids, default=None,
                   help="target layers whose outputs feed the drafter, e.g. 1,9,17 (default: z-lab's spacing)")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id (default: a <|mask|>-like or reserved special token, "
                        "else a spare embedding row)")
    g = p.add_argument_group("data")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"response length the target may write per prompt (default {d.max_new_tokens})")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="target sampling temperature for the responses (default 0 = greedy)")
    g.add_argument("--chat", action="store_true", help='wrap "prompt" strings in the chat template as a user message')
    g.add_argument("--max-seq-len", type=int, default=None, help="train on at most this many tokens per sequence")
    g.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size,
                   help=f"prompts generated at once (default {d.gen_batch_size})")
    g.add_argument("--gen-max-minutes", type=float, default=None,
                   help="response generation budget: no new batch starts after it, and training uses the "
                        "responses made by then; 0 uses only responses already in --data-dir (default: no limit)")
    g.add_argument("--data-dir", default=None, help="response cache folder, shareable between runs (default OUT/data)")
    g.add_argument("--generate-only", action="store_true",
                   help="only write the responses to the data folder (for several trainings to share)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    g.add_argument("--max-minutes", type=float, default=None,
                   help="optimisation wall-clock budget: training ends at --steps or here, whichever comes first, "
                        "and the learning-rate schedule follows the nearer of the two (default: no limit)")
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--warmup", type=float, default=d.warmup, help=f"warmup fraction of the steps (default {d.warmup})")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default 0)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per step (default {d.batch_size})")
    g.add_argument("--anchors", type=int, default=d.anchors,
                   help=f"random anchors (blocks) per sequence per step (default {d.anchors})")
    g.add_argument("--gamma", type=float, default=None, help="slot-weight decay exp(-(k-1)/gamma) (default 7 for B=16)")
    g.add_argument("--loss", default=d.loss, choices=["ce", "kd"],
                   help="ce: cross-entropy on the target's greedy tokens (the recipe); kd: against the target's "
                        "whole distribution at each label (knowledge distillation) (default ce)")
    g.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed for init, data order, anchors, split (default {d.seed})")
    g.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"checkpoint interval in steps (default {d.save_every})")
    g.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved drafter weights (default bfloat16, as z-lab's)")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if it exists")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available); bf16 autocast on cuda")
    g = p.add_argument_group("held-out tau")
    g.add_argument("--eval-prompts", type=int, default=None,
                   help="prompts held out of training for tau (default: 10%% of them, at most 16)")
    g.add_argument("--eval-file", default=None, help="measure tau on this prompt file instead of a held-out split")
    g.add_argument("--eval-max-tokens", type=int, default=None,
                   help="tokens per held-out generation (default --max-new-tokens)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or messages")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig(
        target=args.target, prompts=args.prompts, out=args.out, block_size=args.block_size, layers=args.layers,
        tap_ids=args.tap_ids, mask_token_id=args.mask_token_id, steps=args.steps, max_minutes=args.max_minutes, lr=args.lr, warmup=args.warmup,
        weight_decay=args.weight_decay, batch_size=args.batch_size, anchors=args.anchors, gamma=args.gamma,
        loss=args.loss,
        max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, temperature=args.temperature,
        chat=args.chat, gen_batch_size=args.gen_batch_size, gen_max_minutes=args.gen_max_minutes, data_dir=args.data_dir,
        generate_only=args.generate_only, eval_prompts=args.eval_prompts,
        eval_file=args.eval_file, eval_max_tokens=args.eval_max_tokens, seed=args.seed, resume=args.resume,
        device=args.device, save_every=args.save_every, save_dtype=args.save_dtype, progress=not args.quiet)
    try:
        train_drafter(cfg)
    except (ValueError, FloatingPointError) as e:  # ConfigError is a ValueError
        print(f"flashdraft train-drafter: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"flashdraft train-drafter: interrupted; a run interrupted while training saves its checkpoint and "
              f"the drafter so far in {args.out}; rerun with --resume to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
