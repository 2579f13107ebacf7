"""One prompt of N tokens through the embedded demo target on the CPU, in passes of at most UB tokens (-ub), then
one generated token; prints the prompt's processing time. Run as a whole process under a timer that reports peak
memory, with two values of UB, to see what the passes change (docs/performance.md):

    /usr/bin/time -v python scripts/cpu/prefill_passes.py 3600 512
    /usr/bin/time -v python scripts/cpu/prefill_passes.py 3600 4096
"""
from __future__ import annotations

import random
import sys

import torch

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine


def main() -> int:
    tokens, ub = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    engine = Engine.load(DEMO_DIR / "target", None, device="cpu", prefill_chunk=ub)
    rng = random.Random(0)
    prompt = [rng.randrange(10, engine.decoder.target.config.vocab_size) for _ in range(tokens)]
    result = engine.generate(prompt, SamplingParams(max_tokens=1), 0)
    print(f"{tokens} prompt tokens in passes of {ub}: {result.stats.prompt_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
