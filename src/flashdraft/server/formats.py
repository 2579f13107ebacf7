"""Response bodies: OpenAI chat/completions (whole and as stream chunks) and llama.cpp's native /completion."""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

from flashdraft import __version__
from flashdraft.server.requests import GenerationRequest

if TYPE_CHECKING:
    from flashdraft.engine.generator import GenerationResult

FINGERPRINT = f"flashdraft-{__version__}"


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


def usage(result: GenerationResult) -> dict:
    s = result.stats
    return {"prompt_tokens": s.prompt_n, "completion_tokens": s.predicted_n,
            "total_tokens": s.prompt_n + s.predicted_n, "prompt_tokens_details": {"cached_tokens": 0}}


class OpenAIFormatter:
    """Builds the bodies of one /v1/chat/completions or /v1/completions request."""

    def __init__(self, request: GenerationRequest, chat: bool):
        self.request = request
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "system_fingerprint": FINGERPRINT, "choices": choices}

    def whole(self, result: GenerationResult) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "finish_reason": result.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        body = self._envelope(self.object, [choice])
        body["usage"] = usage(result)
        body["timings"] = result.stats.timings()
        body["speculative_decoding"] = speculative(result)
        return body

    def _chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
            body = self._envelope("text_completion", [choice])
        if self.request.include_usage:
            body["usage"] = None  # OpenAI's convention: usage only on the last chunk
        return body

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        return self._chunk("", None, role=True) if self.chat else None

    def text_chunk(self, text: str) -> dict:
        return self._chunk(text, None)

    def final_chunks(self, result: GenerationResult) -> list[dict]:
        """The finish_reason chunk, then (with include_usage) the usage chunk; the last one carries timings."""
        finish = self._chunk(None if self.chat else "", result.finish_reason)
        chunks = [finish]
        if self.request.include_usage:
            tail = self._envelope(finish["object"], [])
            tail["usage"] = usage(result)
            chunks.append(tail)
        chunks[-1]["timings"] = result.stats.timings()
        chunks[-1]["speculative_decoding"] = speculative(result)
        return chunks


def native_chunk(text: str, slot_id: int | None, tokens: list[int], predicted: int, evaluated: int) -> dict:
    return {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot_id,
            "tokens_predicted": predicted, "tokens_evaluated": evaluated}


def native_whole(request: GenerationRequest, result: GenerationResult, slot_id: int | None, n_max: int) -> dict:
    """llama.cpp's /completion result object (also the final chunk of its stream, with content '')."""
    s = result.stats
    p = request.params
    return {
        "index": 0,
        "content": result.text,
        "tokens": list(result.tokens) if request.return_tokens else [],
        "id_slot": slot_id,
        "stop": True,
        "model": request.model,
        "tokens_predicted": s.predicted_n,
        "tokens_evaluated": s.prompt_n,
        "generation_settings": {
            "n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "seed": result.seed, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "speculative.n_max": n_max, "speculative.n_min": request.n_min,
        },
        "prompt": request.prompt_text,
        "has_new_line": "\n" in result.text,
        "truncated": False,
        "stop_type": result.stop_type,
        "stopping_word": result.stopping_word,
        "tokens_cached": s.prompt_n + s.predicted_n,
        "timings": s.timings(),
        "speculative_decoding": speculative(result),
    }
