"""Peak GPU memory of the walkthrough's serving setup (issue #20): a GGUF target with a random Q5_K DFlash drafter
of z-lab's layout for it (side_by_side_gguf.build_drafter), `--ctx-size 32768 -ctk q5_0 -ctv q4_1
--spec-dflash-cross-ctx 1024`, warmed up as `flashdraft serve` warms a slot, then a prompt filling the context
but for --tokens and DFlash decoding of --tokens tokens (drafts of the full block, verified).

The H200 is made a 24 GB card for the run: torch's allocator may hold at most 24 GB (24e9 bytes) less what the
process holds outside it (the CUDA context and libraries, measured after a first matmul), so that the allocator
frees cached blocks and retries as it would on such a card, and an out-of-memory error means it does not fit.
Reports torch's peak allocated and reserved bytes per phase, and the peak on the GPU: the peak reserved plus what
the process holds outside torch's pool at the end (nvidia-smi).

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/memory_fit.py FILE.gguf OUT [--context 32768]
    [--cache-type-k q5_0] [--cache-type-v q4_1] [--cross-ctx 1024] [--drafter Q5_K] [--tokens 128] [-ub N]
Writes OUT/memory_fit.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import side_by_side_gguf  # noqa: E402  (build_drafter: the random drafter of the target's family)

from flashdraft.cli import use_allocator_settings  # noqa: E402
from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402
from flashdraft.engine.model_prep import resolve_plan  # noqa: E402
from flashdraft.models import load_model  # noqa: E402

def process_gpu_bytes() -> int | None:
    """This process's GPU memory as nvidia-smi reports it (None where it cannot tell)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used) * 2**20
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--cache-type-k", default="q5_0")
    ap.add_argument("--cache-type-v", default="q4_1")
    ap.add_argument("--cross-ctx", type=int, default=1024)
    ap.add_argument("--drafter", default="Q5_K", choices=["Q5_K", "Q8_0", "Q4_K", "Q6_K", "bf16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=None,
                    help="a prompt's passes, at most this many tokens (serve's -ub; default config.PREFILL_CHUNK)")
    ap.add_argument("--limit-gb", type=float, default=24.0, help="the card's memory, GB (1e9 bytes)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    use_allocator_settings()  # as the flashdraft command sets them, before CUDA's first allocation
    dev = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"file": str(args.file), "context": args.context, "cache_type_k": args.cache_type_k,
                    "cache_type_v": args.cache_type_v, "cross_ctx": args.cross_ctx, "drafter": args.drafter,
                    "ubatch_size": args.ubatch_size,
                    "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                    "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    save = lambda: (args.out / "memory_fit.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    phases = result["phases"] = {}
    torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)  # the context and cuBLAS loaded
    torch.cuda.synchronize()
    outside = process_gpu_bytes()
    if outside is None:
        print("nvidia-smi did not report this process: no limit to set", file=sys.stderr)
        return 2
    outside -= torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(dev).total_memory
    pool = args.limit_gb * 1e9 - outside
    torch.cuda.set_per_process_memory_fraction(pool / total, dev)
    result["outside_pool_at_start_gb"], result["pool_limit_gb"] = outside / 1e9, pool / 1e9

    def phase(name: str) -> None:
        torch.cuda.synchronize()
        phases[name] = {"allocated_gb": torch.cuda.memory_allocated() / 1e9,
                        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
        print(f"{name}: {phases[name]}", flush=True)
        save()

    t = time.time()
    try:
        run(args, dev, result, phase)
    except torch.OutOfMemoryError as e:
        result["out_of_memory"] = str(e).splitlines()[0]
        result["under_limit"] = False
        save()
        print(f"out of memory under the {args.limit_gb} GB limit: {result['out_of_memory']}", flush=True)
        return 1
    result["load_and_run_s"] = round(time.time() - t, 1)
    reserved_now, used_now = torch.cuda.memory_reserved(), process_gpu_bytes()
    result["process_gpu_gb_at_end"] = used_now / 1e9 if used_now is not None else None
    if used_now is not None:
        overhead = used_now - reserved_now  # what the process holds beyond torch's pool
        result["outside_pool_at_end_gb"] = overhead / 1e9
        result["peak_gpu_gb"] = (torch.cuda.max_memory_reserved() + overhead) / 1e9
        result["under_limit"] = result["peak_gpu_gb"] < args.limit_gb
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}), flush=True)
    return 0


def run(args, dev, result: dict, phase) -> None:
    loaded = load_model(args.file, device=dev, dtype=torch.bfloat16, context_size=args.context,
                        plan=resolve_plan(dev, block_size=16))
    target = loaded.target
    phase("target loaded")
    gen = torch.Generator(device=dev).manual_seed(0)
    drafter = side_by_side_gguf.build_drafter(target, loaded.context_size + 64, args.drafter, False, dev,
                                              torch.bfloat16, gen)
    phase("drafter built")
    engine = Engine(target, loaded.tokenizer, drafter, context_size=loaded.context_size,
                    cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, draft_window=args.cross_ctx,
                    prefill_chunk=args.ubatch_size)
    sequence = engine.new_sequence()
    phase("engine and caches")
    result["warm_up_s"] = round(engine.warm_up(sequence) or 0.0, 1)
    phase("warmed up")
    prompt = side_by_side_gguf.prompt_of(loaded.context_size - args.tokens, target.config.vocab_size, seed=1)
    out = engine.generate(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True),
                          drafter.block_size - 1, sequence)
    result["prompt_n"], result["generated"] = len(prompt), len(out.tokens)
    result["prompt_ms"], result["tau"] = round(out.stats.prompt_ms, 1), out.stats.tau
    phase("prompt and DFlash decoding")


if __name__ == "__main__":
    sys.exit(main())
