"""Response bodies: OpenAI chat/completions (whole and as stream chunks) and llama.cpp's native /completion.

A chat choice's text goes through the request's output splitting before it is sent: thinking into
`reasoning_content` (below), tool calls into `tool_calls` (tools.py); streamed, each piece is released as
soon as it cannot be part of a marker. Log-probabilities come in each route's own shape, a streamed chunk carrying
those of its tokens.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashdraft import __version__
from flashdraft.server.tools import ToolCall, ToolStream

if TYPE_CHECKING:
    from flashdraft.engine.generator import GenerationResult, TokenLogprob
    from flashdraft.server.requests import GenerationRequest

FINGERPRINT = f"flashdraft-{__version__}"

# Thinking text out of the answer: llama-server's --reasoning-format. Models that think write their reasoning
# between markers before the answer: Qwen3 `<think>...</think>`, Gemma 4 `<|channel>thought\n...<channel|>`. With
# the deepseek (or auto) format, that text goes to the message's `reasoning_content` (streamed as
# `delta.reasoning_content`) and out of `content`; with none it stays in the content. The markers are read off the
# chat template's text; a generation prompt that already opens the thought (a template that pre-fills `<think>`)
# starts the output inside it.

REASONING_FORMATS = ("none", "deepseek", "auto")  # --reasoning-format
MARKERS = {"<think>": ("<think>", "</think>"), "<|channel>": ("<|channel>thought", "<channel|>")}


@dataclass(frozen=True)
class Reasoning:
    open: str
    close: str
    starts_inside: bool  # the prompt ends inside an opened thought


def reasoning_for(template: str, prompt: str, fmt: str) -> Reasoning | None:
    """How to split this request's output, or None to leave it whole (format none, or a template that does not
    think)."""
    if fmt == "none":
        return None
    for key, (open_, close) in MARKERS.items():
        if key in template:
            tail = prompt.rstrip()
            return Reasoning(open_, close, tail.endswith(open_))
    return None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (held back: it may become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) pieces; finish() releases what was held back.

    The thought comes without the whitespace around it (Qwen3 writes `<think>` and its newline as separate
    tokens): whitespace at its start is dropped, whitespace inside it is held until more thought follows, so the
    pieces join to exactly what split_reasoning gives for the whole text, however the text is cut."""

    def __init__(self, reasoning: Reasoning):
        self.r = reasoning
        self.state = "inside" if reasoning.starts_inside else "before"
        self.buffer = ""
        self.thought_started = False  # a thought's first non-blank character was released
        self.strip_content = False  # content right after the thought starts without the blank lines between

    def _thought(self, text: str) -> str:
        """What of text (a run of the thought) can be released now: none of its leading whitespace."""
        if not self.thought_started:
            text = text.lstrip()
            self.thought_started = bool(text)
        return text

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        while True:
            if self.state == "before":
                head = self.buffer.lstrip()
                if head.startswith(self.r.open):
                    self.buffer = head[len(self.r.open):]
                    self.state = "inside"
                    continue
                if not head or self.r.open.startswith(head):
                    return reasoning, content
                self.state = "after"
                continue
            if self.state == "inside":
                end = self.buffer.find(self.r.close)
                if end >= 0:
                    reasoning += self._thought(self.buffer[:end].rstrip())
                    self.buffer = self.buffer[end + len(self.r.close):]
                    self.state, self.strip_content = "after", True
                    continue
                ready = self.buffer[:len(self.buffer) - _partial_tail(self.buffer, self.r.close)].rstrip()
                reasoning += self._thought(ready)
                self.buffer = self.buffer[len(ready):]
                return reasoning, content
            if self.strip_content:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return reasoning, content
                self.strip_content = False
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "inside":
            return self._thought(rest.rstrip()), ""
        return "", rest.lstrip() if self.strip_content else rest


def split_reasoning(text: str, reasoning: Reasoning) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    splitter = ReasoningSplitter(reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2


def sse(payload: dict | str) -> bytes:
    """One server-sent event; never a non-JSON number (a NaN or infinity raises instead of sending `Infinity`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()


def speculative(result: GenerationResult) -> dict:
    """Per-request speculative-decoding summary in vLLM's names; mean_acceptance_length (tau) counts the bonus
    token: tokens committed per decoding step."""
    s = result.stats
    return {"mean_acceptance_length": s.tau, "draft_acceptance_rate": s.acceptance_rate, "num_spec_steps": s.steps,
            "num_draft_tokens": s.draft_n, "num_accepted_draft_tokens": s.draft_n_accepted,
            "accepted_per_position": list(s.accepted_per_position),
            "draft_lengths": {str(k): v for k, v in sorted(s.draft_lengths.items())}}


def usage(results: list[GenerationResult]) -> dict:
    """Token counts: the prompt once (its tokens found in the cache among them), the completions of every choice."""
    first = results[0].stats
    prompt = first.prompt_tokens
    completion = sum(r.stats.predicted_n for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": first.cache_n}}


def _logprob(value: float) -> float:
    """A logprob JSON can carry: a banned token's -inf as OpenAI's floor."""
    return max(float(value), -9999.0)


# --- log-probabilities, per route's shape --------------------------------------------------------------------


def _token_entries(tokenizer, entries: list[TokenLogprob], with_id: bool) -> list[dict]:
    """Each token's {token, logprob, bytes} (and id) with its top_logprobs alike: OpenAI chat's and llama-server's
    shape."""
    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        entry = {"token": raw.decode("utf-8", errors="replace"), "logprob": _logprob(logprob), "bytes": list(raw)}
        return {"id": token_id, **entry} if with_id else entry

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """OpenAI chat's logprobs.content items."""
    return _token_entries(tokenizer, entries, with_id=False)


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int) -> dict:
    """OpenAI legacy completions' logprobs object; offset: where the first token's text starts in the choice."""
    tokens = [tokenizer.token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{tokenizer.token_text(t): _logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def native_probabilities(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """llama-server's completion_probabilities."""
    return _token_entries(tokenizer, entries, with_id=True)


# --- a chat choice's text split into reasoning, content and tool calls -------------------------------------------


@dataclass
class ChatMessage:
    content: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def openai(self) -> dict:
        message = {"role": "assistant", "content": (self.content.strip() or None) if self.tool_calls
                   else self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [c.openai() for c in self.tool_calls]
        return message


def chat_message(request: GenerationRequest, text: str) -> ChatMessage:
    reasoning, content = split_reasoning(text, request.reasoning) if request.reasoning else ("", text)
    if request.tools is None:
        return ChatMessage(content, reasoning)
    content, calls = request.tools.parse(content)
    return ChatMessage(content, reasoning, calls)


class ChatSplitter:
    """A streamed chat choice's text as (reasoning, content) pieces, tool calls held back to the end."""

    def __init__(self, request: GenerationRequest):
        self.reasoning = ReasoningSplitter(request.reasoning) if request.reasoning else None
        self.tools = ToolStream(request.tools) if request.tools else None

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return reasoning, self.tools.feed(content) if self.tools else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return reasoning, content, []
        content = self.tools.feed(content)
        rest, calls = self.tools.finish()
        return reasoning, content + rest, calls


def finish_reason(result: GenerationResult, calls: list) -> str:
    """"tool_calls" when calls were made, but "length" whenever max_tokens cut the output: the client must know
    the reply is incomplete (a call it cut does not parse and stays in the content)."""
    return "tool_calls" if calls and result.finish_reason != "length" else result.finish_reason


class OpenAIFormatter:
    """Builds the bodies of one /v1/chat/completions or /v1/completions request (n choices)."""

    def __init__(self, request: GenerationRequest, chat: bool, tokenizer):
        self.request = request
        self.chat = chat
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.splitters = [ChatSplitter(request) for _ in range(request.n)] if chat else []
        self.offsets = [len(request.prompt_text) if request.echo else 0] * request.n  # completions' text_offset
        self.pending: list[list] = [[] for _ in range(request.n)]  # logprobs not yet sent, per choice
        self.results: list = []

    @property
    def logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "system_fingerprint": FINGERPRINT, "choices": choices}

    def _chat_logprobs(self, entries) -> dict | None:
        return {"content": chat_logprobs(self.tokenizer, entries)} if self.logprobs else None

    def _completion_logprobs(self, index: int, entries) -> dict | None:
        if not self.logprobs:
            return None
        body = completion_logprobs(self.tokenizer, entries, self.offsets[index])
        if body["tokens"]:
            self.offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = []
        for i, result in enumerate(results):
            entries = result.logprobs or []
            if self.chat:
                message = chat_message(self.request, result.text)
                choices.append({"index": i, "message": message.openai(), "logprobs": self._chat_logprobs(entries),
                                "finish_reason": finish_reason(result, message.tool_calls)})
            else:
                text = (self.request.prompt_text if self.request.echo else "") + result.text
                choices.append({"index": i, "text": text, "finish_reason": result.finish_reason,
                                "logprobs": self._completion_logprobs(i, entries)})
        body = self._envelope(self.object, choices)
        body["usage"] = usage(results)
        body["timings"] = results[-1].stats.timings()
        body["speculative_decoding"] = speculative(results[-1])
        return body

    def progress_chunk(self, progress) -> dict:
        """A stream chunk with no choices that reports the prompt's processing (llama-server's return_progress)."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["prompt_progress"] = progress.as_dict()
        return body

    def _chunk(self, index: int, delta: dict | str, finish: str | None, entries=None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": self._chat_logprobs(entries or [])}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish,
                      "logprobs": self._completion_logprobs(index, entries or [])}
            body = self._envelope("text_completion", [choice])
        if self.request.include_usage:
            body["usage"] = None  # OpenAI's convention: usage only on the last chunk
        return body

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI's do; echoed completions with the
        prompt."""
        if self.chat:
            return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(self.request.n)]
        if self.request.echo:
            return [self._chunk(i, self.request.prompt_text, None) for i in range(self.request.n)]
        return []

    def _take(self, index: int, entries) -> list:
        taken, self.pending[index] = self.pending[index] + list(entries or []), []
        return taken

    def delta_chunks(self, index: int, text: str, entries) -> list[dict]:
        """The chunks of a Delta of choice `index` (none while its text is held back: its logprobs wait too)."""
        if not self.chat:
            return [self._chunk(index, text, None, self._take(index, entries))] if text or entries else []
        reasoning, content = self.splitters[index].feed(text)
        if not reasoning and not content:
            self.pending[index] += list(entries or [])
            return []
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return [self._chunk(index, delta, None, self._take(index, entries))]

    def final_chunks(self, index: int, result: GenerationResult) -> list[dict]:
        """Choice `index`'s last chunks: held-back text and tool calls, its finish_reason; after the last choice,
        (with include_usage) the usage chunk. The last chunk carries timings."""
        self.results.append(result)
        chunks, calls = [], []
        if self.chat:
            reasoning, content, calls = self.splitters[index].finish()
            delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
            if delta:
                chunks.append(self._chunk(index, delta, None, self._take(index, [])))
            for j, call in enumerate(calls):
                chunks.append(self._chunk(index, {"tool_calls": [call.openai(j)]}, None))
            chunks.append(self._chunk(index, {}, finish_reason(result, calls), self._take(index, [])))
        else:
            chunks.append(self._chunk(index, "", result.finish_reason, self._take(index, [])))
        if index + 1 < self.request.n:
            return chunks
        if self.request.include_usage:
            tail = self._envelope(chunks[-1]["object"], [])
            tail["usage"] = usage(self.results)
            chunks.append(tail)
        chunks[-1]["timings"] = result.stats.timings()
        chunks[-1]["speculative_decoding"] = speculative(result)
        return chunks


def native_chunk(text: str, slot_id: int | None, tokens: list[int], predicted: int, evaluated: int,
                 probabilities: list[dict] | None = None) -> dict:
    chunk = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot_id,
             "tokens_predicted": predicted, "tokens_evaluated": evaluated}
    if probabilities is not None:
        chunk["completion_probabilities"] = probabilities
    return chunk


def native_whole(request: GenerationRequest, result: GenerationResult, slot_id: int | None, n_max: int,
                 tokenizer) -> dict:
    """llama.cpp's /completion result object (also the final chunk of its stream, with content '')."""
    s = result.stats
    p = request.params
    body = {
        "index": 0,
        "content": result.text,
        "tokens": list(result.tokens) if request.return_tokens else [],
        "id_slot": slot_id,
        "stop": True,
        "model": request.model,
        "tokens_predicted": s.predicted_n,
        "tokens_evaluated": s.prompt_tokens,
        "generation_settings": {
            "n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "seed": result.seed, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "repeat_penalty": p.repeat_penalty, "repeat_last_n": p.repeat_last_n,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "n_probs": p.logprobs or 0, "grammar": p.constraint.source if p.constraint else "",
            "speculative.n_max": n_max, "speculative.n_min": request.n_min,
        },
        "prompt": request.prompt_text,
        "has_new_line": "\n" in result.text,
        "truncated": False,
        "stop_type": result.stop_type,
        "stopping_word": result.stopping_word,
        "tokens_cached": s.prompt_tokens + s.predicted_n,
        "timings": s.timings(),
        "speculative_decoding": speculative(result),
    }
    if p.logprobs is not None:
        body["completion_probabilities"] = native_probabilities(tokenizer, result.logprobs or [])
    return body
