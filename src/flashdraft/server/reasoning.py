"""Thinking text out of the answer: llama-server's --reasoning-format.

Models that think write their reasoning between markers before the answer: Qwen3 `<think>...</think>`, Gemma 4
`<|channel>thought\n...<channel|>`. With the deepseek (or auto) format, that text goes to the message's
`reasoning_content` (streamed as `delta.reasoning_content`) and out of `content`; with none it stays in the
content. The markers are read off the chat template's text; a generation prompt that already opens the
thought (a template that pre-fills `<think>`) starts the output inside it.
"""
from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("none", "deepseek", "auto")
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
