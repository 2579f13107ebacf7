"""Running the benchmark: the same prompts plain and with DFlash, in process or against running servers.

Both backends answer `generate(case, dflash) -> Measurement`; `run_bench` drives either one: one warm-up
generation each way (not timed), then --reps timed repetitions of every prompt both ways. A conversation
is run turn by turn, the baseline's first reply fed back as the assistant turn so that both ways see the
same conversation.
"""
from __future__ import annotations

import copy
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

from flashdraft.bench.prompts import BenchPrompt
from flashdraft.bench.report import Measurement, PromptResult, median_ttft, tau
from flashdraft.config import SamplingParams

# Tokens each way for the warm-up generation: enough to touch every code path (prefill, drafting, verify).
WARMUP_TOKENS = 32


class BenchError(Exception):
    """A benchmark that cannot go on; the message names the prompt, server or setting at fault."""


@dataclass(frozen=True)
class Case:
    """One prompt as sent: raw text or chat messages."""

    name: str
    prompt: str | None = None
    messages: list[dict] | None = None


class Backend(Protocol):
    def generate(self, case: Case, dflash: bool, max_tokens: int | None = None,
                 warmup: bool = False) -> Measurement: ...


class InProcessBackend:
    """One loaded Engine; the baseline is draft length 0 on the same code path, same sampling and seed.

    DFlash runs share one draft policy (draft: a DraftPolicy or a fixed length; None: engine.make_policy()),
    made once like a server slot's, so that an adaptive policy learns across prompts as it would in
    `flashdraft serve` (not from the warm-up, which drafts with a copy). Every repetition of a prompt starts from
    the policy's state at the prompt's start (start_prompt), so the repetitions make the same draft decisions
    (greedy: the same steps) and their spread is the machine's noise; the next prompt goes on from where the last
    repetition left it.

    context > 0 (`--context N`): every prompt is preceded by N tokens of Python source (this package's own
    files, after the BOS token where the model has one), so the same prompts run at a depth of N tokens of
    context, as llama-bench's -d does with its filler.
    """

    def __init__(self, engine, params: SamplingParams, draft=None, context: int = 0):
        self.engine, self.params = engine, params
        self.dflash_draft = engine.make_policy() if draft is None else draft
        self._prompt_start = None  # a copy of the policy as the current prompt found it
        self.context_ids = context_filler(engine.tokenizer, context) if context else []

    def start_prompt(self) -> None:
        self._prompt_start = None if isinstance(self.dflash_draft, int) else copy.deepcopy(self.dflash_draft)

    def generate(self, case: Case, dflash: bool, max_tokens: int | None = None,
                 warmup: bool = False) -> Measurement:
        """One generation. The warm-up drafts with a throwaway copy of the policy: the first prompt meets a fresh
        one, as `flashdraft generate` and a fresh server slot's first request do."""
        params = self.params if max_tokens is None else replace_max_tokens(self.params, max_tokens)
        draft = self.dflash_draft if dflash else 0
        if dflash and warmup:
            draft = copy.deepcopy(draft)
        elif dflash and self._prompt_start is not None:
            draft = self.dflash_draft = copy.deepcopy(self._prompt_start)
        try:
            ids = (self.engine.encode_prompt(messages=case.messages) if case.messages is not None
                   else self.engine.encode_prompt(case.prompt))
            if self.context_ids:
                bos = getattr(self.engine.tokenizer.hf, "bos_token_id", None)
                head = 1 if ids and bos is not None and ids[0] == bos else 0
                ids = ids[:head] + self.context_ids + ids[head:]
            result = self.engine.generate(ids, params, draft)
        except ValueError as e:
            raise BenchError(f"prompt {case.name!r}: {e}") from e
        s = result.stats
        return Measurement(predicted_n=s.predicted_n, predicted_ms=s.predicted_ms, prompt_n=s.prompt_n,
                           prompt_ms=s.prompt_ms, text=result.text, draft_n=s.draft_n,
                           draft_n_accepted=s.draft_n_accepted, steps=s.steps,
                           draft_lengths=dict(s.draft_lengths), tokens=list(result.tokens), ttft_ms=s.prompt_ms,
                           cache_n=s.cache_n)


def context_filler(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of this package's Python sources (sorted by path, repeated if too short)."""
    if tokenizer is None:
        raise BenchError("--context needs the model's tokenizer")
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(path.read_text(encoding="utf-8") for path in sorted(root.rglob("*.py")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise BenchError("--context: the filler text encodes to no tokens")
    return (ids * (tokens // len(ids) + 1))[:tokens]


def replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=min(params.max_tokens, max_tokens))


class ServerBackend:
    """OpenAI-style HTTP: chat messages to /v1/chat/completions, raw prompts to /v1/completions, streamed.

    The baseline goes to baseline_url if given, else to the same server with "speculative.n_max": 0 (the
    per-request override of llama-server forks and `flashdraft serve`). Numbers come from llama.cpp's `timings`
    object, which the last chunk of a stream carries, and the time to the first chunk with text, measured here;
    servers return no token ids, so `identical` compares text.
    """

    def __init__(self, url: str, baseline_url: str | None, params: SamplingParams, draft_n: int | None = None,
                 timeout: float = 600.0):
        self.url = normalize_url(url)
        self.baseline_url = normalize_url(baseline_url) if baseline_url else None
        self.params, self.draft_n, self.timeout = params, draft_n, timeout

    def request_body(self, case: Case, dflash: bool, max_tokens: int) -> dict:
        p = self.params
        body = {"model": "bench", "stream": True, "max_tokens": max_tokens, "temperature": p.temperature,
                "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "seed": p.seed}
        if case.messages is not None:
            body["messages"] = case.messages
        else:
            body["prompt"] = case.prompt
        if not dflash and self.baseline_url is None:
            body["speculative.n_max"] = 0
        if dflash and self.draft_n is not None:
            body["speculative.n_max"] = self.draft_n
        return body

    def generate(self, case: Case, dflash: bool, max_tokens: int | None = None,
                 warmup: bool = False) -> Measurement:
        base = self.url if dflash or self.baseline_url is None else self.baseline_url
        endpoint = "/v1/chat/completions" if case.messages is not None else "/v1/completions"
        n = self.params.max_tokens if max_tokens is None else min(max_tokens, self.params.max_tokens)
        chat = case.messages is not None
        chunks, ttft = post_stream(base + endpoint, self.request_body(case, dflash, n), self.timeout, chat)
        m = parse_stream(chunks, base + endpoint, chat, ttft)
        if not dflash and m.draft_n > 0:
            raise BenchError(f"the baseline request to {base} drafted {m.draft_n} tokens: that server ignores "
                             "\"speculative.n_max\": 0; pass --baseline-url of a server started without a drafter")
        return m


def normalize_url(url: str) -> str:
    """Accept a server root or an OpenAI base URL (ending in /v1)."""
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"server URL must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def post_stream(url: str, body: dict, timeout: float, chat: bool) -> tuple[list[dict], float | None]:
    """The chunks of a streamed response (server-sent events) and the milliseconds from sending the request to
    the first chunk with text (None when none had any)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    chunks, ttft = [], None
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError as e:
                    raise BenchError(f"{url} streamed a chunk that is not JSON: {data[:200]!r}") from e
                if isinstance(chunk, dict) and "error" in chunk:
                    raise BenchError(f"{url} streamed an error: {error_message(data.encode())}")
                chunks.append(chunk)
                if ttft is None and chunk_text(chunk, chat):
                    ttft = 1000 * (time.perf_counter() - start)
    except urllib.error.HTTPError as e:
        raise BenchError(f"{url} answered HTTP {e.code}: {error_message(e.read())}") from e
    except (urllib.error.URLError, ConnectionError) as e:
        raise BenchError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from e
    except (TimeoutError, socket.timeout) as e:
        raise BenchError(f"{url} did not answer within {timeout:g} s (--timeout)") from e
    return chunks, ttft


def chunk_text(chunk: dict, chat: bool) -> str:
    """A stream chunk's text (chat: the delta's content; completions: the choice's text)."""
    try:
        choice = chunk["choices"][0]
        text = choice["delta"].get("content") if chat else choice.get("text")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    return text if isinstance(text, str) else ""


def error_message(raw: bytes) -> str:
    """The error text of an OpenAI/llama-server style error body, else the body itself."""
    try:
        error = json.loads(raw).get("error")
        return error.get("message", str(error)) if isinstance(error, dict) else str(error or raw[:300])
    except (json.JSONDecodeError, AttributeError):
        return raw[:300].decode(errors="replace")


def parse_stream(chunks: list[dict], url: str, chat: bool, ttft_ms: float | None) -> Measurement:
    """A Measurement from a stream's chunks: the text they carry and the last chunk's timings."""
    timings = next((c["timings"] for c in reversed(chunks) if isinstance(c, dict) and "timings" in c), None)
    if not isinstance(timings, dict):
        raise BenchError(f"{url}: the stream has no 'timings' object; bench needs a server that reports "
                         "llama.cpp timings (flashdraft serve, llama-server)")
    try:
        return Measurement(predicted_n=int(timings["predicted_n"]), predicted_ms=float(timings["predicted_ms"]),
                           prompt_n=int(timings["prompt_n"]), prompt_ms=float(timings["prompt_ms"]),
                           text="".join(chunk_text(c, chat) for c in chunks),
                           draft_n=int(timings.get("draft_n", 0)),
                           draft_n_accepted=int(timings.get("draft_n_accepted", 0)), ttft_ms=ttft_ms,
                           cache_n=int(timings.get("cache_n", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise BenchError(f"{url}: unexpected timings ({type(e).__name__}: {e})") from e


def run_bench(backend: Backend, prompts: list[BenchPrompt], reps: int,
              on_generation: Callable[[], None] = lambda: None,
              on_result: Callable[[PromptResult], None] = lambda r: None) -> list[PromptResult]:
    """Warm up once each way, then every prompt (every turn) reps times each way, alternating."""
    warm_up(backend, first_case(prompts[0]), on_generation)
    results = []
    for prompt in prompts:
        for result in run_prompt(backend, prompt, reps, on_generation):
            results.append(result)
            on_result(result)
    return results


def warm_up(backend: Backend, case: Case, on_generation: Callable[[], None]) -> None:
    """One short untimed generation each way (compiles, graph captures, a server's first request)."""
    for dflash in (False, True):
        backend.generate(case, dflash, max_tokens=WARMUP_TOKENS, warmup=True)
        on_generation()


def run_concurrent(backend: Backend, prompts: list[BenchPrompt], streams: int, reps: int,
                   on_generation: Callable[[], None] = lambda: None) -> dict:
    """Concurrent streams against a server, each way in turn (baseline, then DFlash): `streams` client threads
    at once, each sending every prompt's first case (a conversation's first turn) `reps` times, thread i
    starting at prompt i so that the server's slots hold different prompts. Per way: the wall time of the
    phase, tokens over it (total tok/s), each request's own generation rate as the server reports it
    (per-stream tok/s, the mean over requests), the median time to first token, and tau (tokens a decoding step
    over the way's requests: what a batched step's cost is read against)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [first_case(p) for p in prompts]
    warm_up(backend, cases[0], on_generation)
    ways = {}
    for name, dflash in (("baseline", False), ("dflash", True)):
        def stream(i: int, dflash=dflash) -> list[Measurement]:
            runs = []
            for k in range(reps * len(cases)):
                runs.append(backend.generate(cases[(i + k) % len(cases)], dflash))
                on_generation()
            return runs

        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            runs = [m for ms in pool.map(stream, range(streams)) for m in ms]
        wall = time.perf_counter() - start
        tokens = sum(m.predicted_n for m in runs)
        rates = [1000.0 * m.predicted_n / m.predicted_ms for m in runs if m.predicted_ms > 0]
        ways[name] = {"requests": len(runs), "tokens": tokens, "wall_s": wall, "total_tok_s": tokens / wall,
                      "per_stream_tok_s": sum(rates) / len(rates) if rates else None, "ttft_ms": median_ttft(runs),
                      "draft_n": sum(m.draft_n for m in runs), "draft_n_accepted": sum(m.draft_n_accepted for m in runs),
                      "tau": tau(runs)}
    base, fast = ways["baseline"]["total_tok_s"], ways["dflash"]["total_tok_s"]
    return {"streams": streams, **ways, "speedup": fast / base if base > 0 else None}


def first_case(prompt: BenchPrompt) -> Case:
    if prompt.turns:
        return Case(f"{prompt.name}-1", messages=[{"role": "user", "content": prompt.turns[0]}])
    return Case(prompt.name, prompt=prompt.prompt, messages=prompt.messages)


def run_prompt(backend: Backend, prompt: BenchPrompt, reps: int, on_generation: Callable[[], None]):
    if not prompt.turns:
        yield measure(backend, first_case(prompt), reps, on_generation)
        return
    history: list[dict] = []
    for number, turn in enumerate(prompt.turns, 1):
        history.append({"role": "user", "content": turn})
        result = measure(backend, Case(f"{prompt.name}-{number}", messages=list(history)), reps, on_generation)
        history.append({"role": "assistant", "content": result.baseline[0].text})
        yield result


def measure(backend: Backend, case: Case, reps: int, on_generation: Callable[[], None]) -> PromptResult:
    start_prompt = getattr(backend, "start_prompt", None)
    if start_prompt is not None:
        start_prompt()
    result = PromptResult(case.name, baseline=[], dflash=[])
    for _ in range(reps):
        for dflash, runs in ((False, result.baseline), (True, result.dflash)):
            runs.append(backend.generate(case, dflash))
            on_generation()
    return result
