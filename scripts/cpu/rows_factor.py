"""The demo target's pass over its cache at 1..256 rows on this CPU, against the cost model's rows_factor
(engine.generator: 1.5 + 0.034 T past one row), which prices a batched step's verify rows (docs/adaptive.md).

    python scripts/cpu/rows_factor.py        # median of 15 passes a size, after a 295-token prompt
"""
import statistics
import time

import torch

from flashdraft.config import SamplingParams
from flashdraft.demo import demo_paths
from flashdraft.engine.generator import Engine, rows_factor

engine = Engine.load(*demo_paths(), device="cpu")
decoder = engine.decoder
seq = decoder.new_sequence()
decoder.prefill(seq, list(range(5, 300)), SamplingParams(), 0)


def median_seconds(rows: int, reps: int = 15) -> float:
    tokens = torch.arange(rows) % 300 + 5
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        decoder.target_pass(seq, tokens, 300)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


one = median_seconds(1)
print(f"threads {torch.get_num_threads()}, one row {1000 * one:.2f} ms")
for rows in (2, 4, 8, 16, 32, 64, 128, 256):
    t = median_seconds(rows)
    print(f"{rows:4d} rows {1000 * t:7.2f} ms: {t / one:5.2f}x one row (model {rows_factor(rows, 'cpu'):5.2f}x)")
