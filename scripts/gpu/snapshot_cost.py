"""What saving a slot's prefix to the host prompt cache (--cache-ram) costs a request, and bringing it back.

A Qwen3-8B-shaped KV cache (36 layers, 8 KV heads of 128, bf16) on the GPU, 30244 rows taken (the 5-turn
conversation of scripts/gpu/server_check.sh synthetic): KVCache.snapshot as the engine does it (pinned host
memory, queued), beside a copy to pageable memory as it was done before (measured here for comparison). For each:
the host's time until the call returns (what holds the next request up before its prefill is queued) and the time
until the GPU has finished the copy (what the prefill, queued after it, waits). Then copy_prefix back into another
cache. Three rounds (the first pinned allocation is the host allocator's; later rounds reuse its blocks). Each
round also snapshots into a HostArena pinned beforehand (the server's --cache-ram path), and the last round prints
where that snapshot's host time goes (cProfile).

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/snapshot_cost.py [--rows 30244]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from types import SimpleNamespace

import torch

from flashdraft.models.kv_cache import HostArena, KVCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30244)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = SimpleNamespace(num_key_value_heads=8, head_dim=128, num_hidden_layers=36)
    dev = torch.device("cuda")
    cache = KVCache(cfg, 32768, dev, torch.bfloat16)
    back = KVCache(cfg, 32768, dev, torch.bfloat16)
    for t in cache.k + cache.v:
        t.normal_()
    gb = sum(t[:, :args.rows].numel() * 2 for t in cache.k + cache.v) / 1e9
    print(f"{args.rows} rows of a Qwen3-8B-shaped cache: {gb:.2f} GB")
    arena = HostArena(int(gb * 1e9 * 1.05) + (1 << 20), pin_memory=True)
    print(f"{'round':>5} {'how':<22} {'host ms':>9} {'until copied ms':>16} {'GB/s':>7}")
    for round_ in range(1, args.rounds + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        pageable = [t[:, :args.rows].to("cpu", copy=True) for t in cache.k + cache.v]
        host = time.perf_counter() - started
        torch.cuda.synchronize()
        done = time.perf_counter() - started
        print(f"{round_:>5} {'pageable (before)':<22} {1000 * host:>9.1f} {1000 * done:>16.1f} {gb / done:>7.1f}")
        del pageable
        started = time.perf_counter()
        snap = cache.snapshot(args.rows)
        host = time.perf_counter() - started
        torch.cuda.synchronize()
        done = time.perf_counter() - started
        print(f"{round_:>5} {'snapshot (pinned)':<22} {1000 * host:>9.1f} {1000 * done:>16.1f} {gb / done:>7.1f}")
        started = time.perf_counter()
        back.copy_prefix(snap, args.rows)
        host = time.perf_counter() - started
        torch.cuda.synchronize()
        done = time.perf_counter() - started
        same = all(torch.equal(a[:, :args.rows], b[:, :args.rows]) for a, b in zip(back.k + back.v, cache.k + cache.v))
        print(f"{round_:>5} {'copy_prefix back':<22} {1000 * host:>9.1f} {1000 * done:>16.1f} {gb / done:>7.1f}"
              f"  rows equal: {same}")
        del snap
        profiler = cProfile.Profile() if round_ == args.rounds else None
        torch.cuda.synchronize()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        snap = cache.snapshot(args.rows, arena)
        if profiler is not None:
            profiler.disable()
        host = time.perf_counter() - started
        torch.cuda.synchronize()
        done = time.perf_counter() - started
        print(f"{round_:>5} {'snapshot (arena)':<22} {1000 * host:>9.1f} {1000 * done:>16.1f} {gb / done:>7.1f}")
        del snap
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main())
