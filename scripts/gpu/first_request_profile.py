"""Where a server's first request spends the time outside prompt processing (issue #24): the demo pair served in
this process (the worker warmed up as `flashdraft serve` does), then new 100-token prompts through /completion as
scripts/gpu/ttft_check.py sends them, while a sampler thread records every thread's Python stack each
millisecond. Prints per request the time to first token beside the server's prompt_ms, and for the first and the
second request the functions seen most often in the server's threads (the sampler's and the client's aside).

Usage (repo root, GPU machine; also runs on a CPU): PYTHONPATH=src python scripts/gpu/first_request_profile.py
    [--spec-type dflash|none] [--requests 3] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft_check import over_http, prompts  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "src" / "flashdraft" / "demo"


class StackSampler(threading.Thread):
    """Every `period` seconds, each other thread's stack, as (thread name, innermost-first frames) tuples."""

    def __init__(self, period: float = 0.001):
        super().__init__(daemon=True, name="sampler")
        self.period, self.samples, self.running, self.skip = period, [], threading.Event(), set()

    def run(self) -> None:
        names = {}
        while True:
            if self.running.is_set():
                for ident, frame in sys._current_frames().items():
                    if ident in self.skip:
                        continue
                    if ident not in names:
                        names = {t.ident: t.name for t in threading.enumerate()}
                    stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)]
                    self.samples.append((names.get(ident, str(ident)), tuple(reversed(stack))))
            time.sleep(self.period)

    def take(self) -> list:
        samples, self.samples = self.samples, []
        return samples


def report(samples: list, top: int, period_ms: float) -> None:
    """Per thread: samples in all, the frames seen most often (inclusive), the innermost 5 frames seen most often."""
    by_thread = collections.defaultdict(list)
    for name, stack in samples:
        by_thread[name].append(stack)
    for name, stacks in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        busy = [s for s in stacks if not _idle(s)]
        print(f"  thread {name}: {len(stacks)} samples, {len(busy)} not waiting (~{len(busy) * period_ms:.0f} ms)")
        inclusive, innermost = collections.Counter(), collections.Counter()
        for s in busy:
            inclusive.update(set(s))
            innermost[s[:5]] += 1
        for frame, n in inclusive.most_common(top):
            print(f"    {n:5d}  {frame}")
        for frames, n in innermost.most_common(6):
            print(f"    {n:5d}  innermost: {' < '.join(frames)}")


def _idle(stack: tuple) -> bool:
    top = stack[0] if stack else ""
    return any(w in top for w in (" wait", " select", " _worker", " get", " sleep", " poll", " run_forever",
                                  " _run_once", " accept"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-type", default="dflash", choices=["dflash", "none"])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()

    from flashdraft.server.app import ServerState
    from flashdraft.server.cli import serve_in_thread
    from flashdraft.server.settings import ServerSettings

    drafter = str(DEMO / "drafter") if args.spec_type == "dflash" else None
    settings = ServerSettings(model=str(DEMO / "target"), drafter=drafter, alias=None, ctx_size=4096, temperature=0.7, top_k=64,
                              top_p=0.95, min_p=0.0, **({"device": args.device} if args.device else {}))
    state = ServerState(settings)
    started = time.perf_counter()
    state.load(on_failure=lambda: None)
    if state.load_error is not None:
        raise state.load_error
    print(f"loaded and warmed up in {time.perf_counter() - started:.1f} s")
    server, url = serve_in_thread(state)
    sampler = StackSampler()
    sampler.start()
    sampler.skip = {threading.get_ident(), sampler.ident}  # the client (this thread) and the sampler itself
    vocab = state.engine.decoder.target.config.vocab_size
    print("request  ttft ms  prompt ms")
    for i, ids in enumerate(prompts([100] * args.requests, vocab, seed=31)):
        sampler.running.set()
        row = over_http(url, ids, timeout=60)
        sampler.running.clear()
        samples = sampler.take()
        print(f"{i + 1:7d} {row['ttft_ms']:8.1f} {row['server_prompt_ms']:10.1f}", flush=True)
        if i < 2:
            report(samples, args.top, 1.0)
    server.should_exit = True
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
