"""CUDA graph capture of the fixed-shape passes of the loop (decode, verify, draft).

A batch-1 step launches hundreds of small kernels; replaying them as one graph removes the launch gaps. Each
graph is keyed by its shapes (and the cache it writes, through `lifetime_key`, since a graph bakes in its
tensors' addresses): tokens per pass, and the attention length rounded up to a bucket, with rows past a query's
position hidden by the position mask. Captures happen on first use; inputs are copied into the graph's static
buffers and the outputs are the graph's static tensors, valid until the next replay of any graph of the cache:
the graphs share one memory pool, so a graph captured later may keep its outputs where an earlier one keeps its
intermediates.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Callable

import torch

KV_BUCKET = 256


def bucket(rows: int, capacity: int) -> int:
    """The attention length a graph is captured for: rows rounded up to KV_BUCKET, at most the capacity."""
    return min(capacity, -(-rows // KV_BUCKET) * KV_BUCKET)


class GraphCache:
    def __init__(self):
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], object]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._tied: dict[int, weakref.finalize] = {}
        # graphs captured so far, by kind (key[0]): a server's /metrics shows them, so that steps of shapes not
        # captured before (a batched step's new composition) show as captures in steady state
        self.captured: Counter[str] = Counter()

    def lifetime_key(self, obj) -> tuple | None:
        """A key part standing for obj (a cache, an oracle) whose tensors a graph bakes in: ("tied", id(obj)), and
        when obj is freed, every graph whose key holds it goes too, before its id can come back on a new object
        (which must not replay a graph of the freed one's memory). None for None."""
        if obj is None:
            return None
        token = ("tied", id(obj))
        if id(obj) not in self._tied:
            self._tied[id(obj)] = weakref.finalize(obj, self._forget, token)
        return token

    def _forget(self, token: tuple) -> None:
        self._tied.pop(token[1], None)
        for key in [k for k in self.graphs if token in k]:
            del self.graphs[key]

    def run(self, key: tuple, fn: Callable, mutable: list[torch.Tensor] = (),
            constants: Callable[[], dict[str, torch.Tensor]] | None = None, **inputs: torch.Tensor):
        """Replay the graph of `key` (capturing fn on first use) on these inputs. mutable: tensors fn updates in
        place from their own values (a step's device state), restored after the warm-up run so that the replay
        starts from what the caller left there. constants: made only when the graph is captured (outside capture),
        tensors whose values the key fixes (a batched step's segment tables): kept with the graph and given to fn
        beside the inputs, never made or copied again."""
        entry = self.graphs.get(key)
        if entry is None:
            static = {k: v.clone() for k, v in inputs.items()}
            if constants is not None:
                static.update(constants())
            saved = [t.clone() for t in mutable]
            # Warm up on a side stream (lazy library init must not happen during capture). fn runs on the real
            # inputs here, so whatever it writes into caches is correct, and the replay below rewrites the same.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(**static)
            torch.cuda.current_stream().wait_stream(side)
            for t, before in zip(mutable, saved):
                t.copy_(before)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(**static)
            entry = self.graphs[key] = (graph, static, out)
            self.captured[key[0]] += 1
        graph, static, out = entry
        for k, v in inputs.items():
            static[k].copy_(v)
        graph.replay()
        return out

    def limit(self, kind: str, count: int) -> None:
        """Keep at most `count` graphs of this kind (key[0]): the oldest captured go (their memory back to the
        pool)."""
        keys = [key for key in self.graphs if key[0] == kind]
        for key in keys[:max(0, len(keys) - count)]:
            del self.graphs[key]

    def __len__(self) -> int:
        return len(self.graphs)
