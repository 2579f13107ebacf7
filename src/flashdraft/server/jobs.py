"""A request's job: what the worker thread tells the request handler, through the handler's event loop.

Events are (kind, payload, choice) triples: ("delta", Delta, i), ("result", GenerationResult, i) for each of the
request's n choices in turn, ("progress", PromptProgress, i) after each prefill pass when the request asked for
it (return_progress), ("error", Exception, i) or ("ended", reason, i) when a job ends without its results
(cancelled, or the server is shutting down). This module
does not import the engine, so the HTTP side starts (and answers /health) while torch is still loading.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Callable

from flashdraft.server.requests import GenerationRequest

DELTA, RESULT, ERROR, ENDED, PROGRESS = "delta", "result", "error", "ended", "progress"


class Job:
    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 cancelled: threading.Event | None = None):
        """cancelled: the request's cancel flag, when it was made before the job (to stop its parsing too)."""
        self.id = next(Job._ids)
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = cancelled or threading.Event()
        self.slot_id: int | None = None
        self.on_cancel: Callable[[Job], None] | None = None  # set by the scheduler that holds the job

    def cancel(self) -> None:
        """Stop the job: a queued one leaves the queue at once (its handler gets "ended"), a running one stops
        before its next step."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def post(self, kind: str, payload, choice: int = 0) -> None:
        """Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload, choice))
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass
