"""`flashdraft` entry point: generate | serve | bench | train-drafter.

Each subcommand owns its argument parser (serve speaks llama-server's flags), so this module only dispatches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashdraft.config import SamplingParams

COMMANDS = {
    "generate": "flashdraft.cli:generate_main",
    "serve": "flashdraft.server.cli:main",
    "bench": "flashdraft.bench.cli:main",
    "train-drafter": "flashdraft.train.cli:main",
}

# The CUDA caching allocator's settings where the user gives none: expandable segments, so that memory one pass's
# sizes freed serves another's. Without them the walkthrough's 24 GB setup ran out of memory with 1 GB reserved but
# unusable (docs/performance.md).
ALLOCATOR_SETTINGS = "expandable_segments:True"

USAGE = """usage: flashdraft {generate,serve,bench,train-drafter} [options]

  generate        generate text from a prompt, with or without a DFlash drafter
  serve           OpenAI- and llama-server-compatible HTTP server with a web chat page
  bench           side-by-side benchmark: plain decoding vs DFlash on the same prompts
  train-drafter   train a DFlash drafter for a target model

Run `flashdraft COMMAND --help` for a command's options. Without -m the embedded demo pair is used."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from flashdraft import __version__
        print(f"flashdraft {__version__}")
        return 0
    target = COMMANDS.get(argv[0])
    if target is None:
        print(f"flashdraft: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    use_allocator_settings()
    module, func = target.split(":")
    import importlib
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


def use_allocator_settings() -> None:
    """ALLOCATOR_SETTINGS unless PYTORCH_CUDA_ALLOC_CONF is set; before CUDA's first allocation, when torch reads
    it."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags in llama.cpp's spelling, shared by generate and bench."""
    p.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k, 0 = off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p, 1 = off (default 1)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random, reported)")


HUB_FLAGS = [("-hf", "-hfr", "--hf-repo"), ("-hfd", "-hfrd", "--hf-repo-draft"), ("-hff", "--hf-file"),
             ("-hfv", "-hfrv", "--hf-repo-v"), ("-hffv", "--hf-file-v"), ("-hft", "--hf-token"),
             ("-mu", "--model-url"), ("-dr", "--docker-repo")]


class _NoHub(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: downloading models from a hub is not supported; download the model and "
                     "pass -m PATH (a model folder or a .gguf file)")


def add_hub_refusals(p: argparse.ArgumentParser) -> None:
    """llama.cpp's download flags, refused by name (argparse would read -hf as -h with the value f)."""
    for group in HUB_FLAGS:
        p.add_argument(*group, action=_NoHub, nargs="?", help=argparse.SUPPRESS)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="target model folder (default: the embedded demo model)")
    p.add_argument("-md", "--spec-draft-model", "--drafter", dest="drafter", default=None,
                   help="DFlash drafter folder (default with no -m: the demo drafter)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding even if a drafter is given")
    p.add_argument("--draft-n", type=int, default=None,
                   help="fixed draft length (default: chosen by the adaptive controller)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="no adaptive draft control: draft the full block (block size - 1) unless --draft-n")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add_cache_args(p)
    add_hub_refusals(p)


# llama.cpp's KV cache type flags: (flags, Engine.load keyword, whose cache)
CACHE_TYPE_FLAGS = [(("-ctk", "--cache-type-k"), "cache_type_k", "the target's keys"),
                    (("-ctv", "--cache-type-v"), "cache_type_v", "the target's values"),
                    (("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k"), "draft_cache_type_k",
                     "the drafter's context keys"),
                    (("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v"), "draft_cache_type_v",
                     "the drafter's context values")]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def _whole_number(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The flags that set what memory the caches and the prompt's passes take: -ctk/-ctv/-ctkd/-ctvd, KV cache types
    (flashdraft.quant.kv_formats; an unknown type is an error naming the supported ones); --spec-dflash-cross-ctx,
    the drafter's context window; -ub/--ubatch-size, the most prompt tokens a prefill pass runs."""
    from flashdraft.config import DRAFT_WINDOW, PREFILL_CHUNK
    from flashdraft.quant.kv_formats import KV_FORMATS
    for flags, dest, whose in CACHE_TYPE_FLAGS:
        p.add_argument(*flags, dest=dest, default=None, choices=list(KV_FORMATS), metavar="TYPE",
                       help=f"KV cache type of {whose}: {', '.join(KV_FORMATS)} (default: the model's dtype)")
    p.add_argument("--spec-dflash-cross-ctx", "-cd", "--spec-draft-ctx-size", "--ctx-size-draft", dest="draft_window",
                   type=_whole_number, default=None, metavar="N",
                   help=f"the drafter sees only the last N committed tokens (its context cache a ring of N + block "
                        f"rows), so its memory and time stay constant as the context grows; 0: all of them "
                        f"(default {DRAFT_WINDOW} with a drafter)")
    p.add_argument("-ub", "--ubatch-size", dest="prefill_chunk", type=_positive_int, default=None, metavar="N",
                   help=f"a prompt runs in passes of at most N tokens, which bounds the memory a long prompt's "
                        f"processing takes (default {PREFILL_CHUNK})")


def given_cache_flags(args) -> list[str]:
    """The flags of add_cache_args that were given, by name (for the modes that refuse them)."""
    flags = [(flags[0], dest) for flags, dest, _ in CACHE_TYPE_FLAGS]
    flags += [("--spec-dflash-cross-ctx", "draft_window"), ("-ub", "prefill_chunk")]
    return [flag for flag, dest in flags if getattr(args, dest) is not None]


def cache_args_from_args(args, drafter: bool) -> dict[str, str | int | None]:
    """The cache flags as Engine.load's keyword arguments. drafter: whether a drafter model is loaded, which takes
    the default drafter window (config.DRAFT_WINDOW; a window without a drafter is Engine.load's error)."""
    from flashdraft.config import DRAFT_WINDOW
    window = args.draft_window
    if window is None:
        window = DRAFT_WINDOW if drafter else None
    elif window == 0:  # all of the context
        window = None
    return {**{dest: getattr(args, dest) for _, dest, _ in CACHE_TYPE_FLAGS}, "draft_window": window,
            "prefill_chunk": args.prefill_chunk}


def resolve_model_paths(model: str | None, drafter: str | None, draft: bool = True) -> tuple[str, str | None]:
    """Explicit paths, or the embedded demo pair when no model is given. draft=False: no drafter at all (plain
    decoding; not even the demo drafter is filled in)."""
    if model is None:
        from flashdraft.demo import demo_paths
        demo_model, demo_drafter = demo_paths()
        model, drafter = str(demo_model), drafter or (str(demo_drafter) if demo_drafter else None)
    return model, drafter if draft else None


def set_threads(threads: int | None) -> None:
    """-t/--threads: torch's CPU threads for the whole run (llama.cpp's -t); None leaves torch's default."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"-t/--threads must be >= 1, got {threads}")
    import torch
    torch.set_num_threads(threads)


def sampling_from_args(args) -> "SamplingParams":
    from flashdraft.config import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.n_predict, stop=list(getattr(args, "stop", None) or []))


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flashdraft generate", description="Generate text, plain or with DFlash.")
    add_model_args(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt (raw text unless --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens and statistics")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    add_sampling_args(p)
    args = p.parse_args(argv)

    from flashdraft.config import ConfigError
    from flashdraft.demo import demo_name
    from flashdraft.engine.generator import Delta, Engine, GenerationResult
    try:
        set_threads(args.threads)
        model, drafter = resolve_model_paths(args.model, args.drafter, draft=not args.no_draft)
        engine = Engine.load(model, drafter, device=args.device, context_size=args.ctx_size,
                             adaptive=not args.no_adaptive, name=demo_name(model),
                             **cache_args_from_args(args, drafter is not None))
        params = sampling_from_args(args)
        params.validate()
        prompt_ids = (engine.encode_prompt(messages=[{"role": "user", "content": args.prompt}]) if args.chat
                      else engine.encode_prompt(args.prompt))
        draft = 0 if args.no_draft else args.draft_n
        if draft is not None and not 0 <= draft <= engine.max_draft:
            raise ValueError(f"--draft-n must be between 0 and {engine.max_draft} (block size - 1), got {draft}")
        result = None
        for event in engine.stream(prompt_ids, params, draft):
            if isinstance(event, Delta) and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, GenerationResult):
                result = event
    except (ConfigError, ValueError) as e:
        print(f"flashdraft generate: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        print(f"[{result.summary()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
