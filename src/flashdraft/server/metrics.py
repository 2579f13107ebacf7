"""Prometheus metrics in llama-server's names (llamacpp:*), plus the speculative-decoding counters it shares
with vLLM (spec_decode_num_*_total, accepted tokens per draft position)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

PREFIX = "llamacpp:"


class ServerMetrics:
    def __init__(self, scheduler_probe=lambda: (0, 0)):
        """scheduler_probe() -> (busy slots, queued requests), read at scrape time."""
        disable_created_metrics()  # llama-server has no *_created series
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._rounds = 0
        self._busy_sum = 0
        self._max_tokens_seen = 0
        self._totals = {"prompt_n": 0.0, "prompt_s": 0.0, "predicted_n": 0.0, "predicted_s": 0.0}
        r = self.registry

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name, doc, fn):
            g = Gauge(PREFIX + name, doc, registry=r)
            g.set_function(fn)
            return g

        self.prompt_tokens = counter("prompt_tokens", "Number of prompt tokens processed.")
        self.prompt_seconds = counter("prompt_seconds", "Prompt process time.")
        self.tokens_predicted = counter("tokens_predicted", "Number of generation tokens processed.")
        self.tokens_predicted_seconds = counter("tokens_predicted_seconds", "Predict process time.")
        self.n_decode = counter("n_decode", "Engine calls made for requests (each a prefill or one or more decoding steps).")
        self.drafts = counter("spec_decode_num_drafts", "Decoding steps that verified a draft.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0 = first).", ["position"])
        self.probe = scheduler_probe
        gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
              lambda: _ratio(self._totals["prompt_n"], self._totals["prompt_s"]))
        gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
              lambda: _ratio(self._totals["predicted_n"], self._totals["predicted_s"]))
        gauge("requests_processing", "Number of requests processing.", lambda: self.probe()[0])
        gauge("requests_deferred", "Number of requests deferred.", lambda: self.probe()[1])
        gauge("n_tokens_max", "Largest observed n_tokens (prompt + generated).", lambda: self._max_tokens_seen)
        gauge("n_busy_slots_per_decode", "Average number of busy slots per decoding round.",
              lambda: _ratio(self._busy_sum, self._rounds))

    def expose_positions(self, max_draft: int) -> None:
        """Export every draft position from the start (at 0), as llama-server and vLLM do."""
        for position in range(max_draft):
            self.accepted_per_pos.labels(position=str(position))

    def on_round(self, busy: int) -> None:
        with self._lock:
            self._rounds += 1
            self._busy_sum += busy

    def on_step(self) -> None:
        self.n_decode.inc()

    def on_result(self, result) -> None:
        s = result.stats
        self.prompt_tokens.inc(s.prompt_n)
        self.prompt_seconds.inc(s.prompt_ms / 1000)
        self.tokens_predicted.inc(s.predicted_n)
        self.tokens_predicted_seconds.inc(s.predicted_ms / 1000)
        self.drafts.inc(s.steps - s.draft_lengths.get(0, 0))
        self.draft_tokens.inc(s.draft_n)
        self.accepted_tokens.inc(s.draft_n_accepted)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        with self._lock:
            self._max_tokens_seen = max(self._max_tokens_seen, s.prompt_tokens + s.predicted_n)
            for key, value in (("prompt_n", s.prompt_n), ("prompt_s", s.prompt_ms / 1000),
                               ("predicted_n", s.predicted_n), ("predicted_s", s.predicted_ms / 1000)):
                self._totals[key] += value

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
