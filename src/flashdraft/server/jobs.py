"""A request's job: what the worker thread tells the request handler, through the handler's event loop.

Events are (kind, payload) pairs: ("delta", Delta), ("result", GenerationResult), ("error", Exception) or
("ended", reason) when a job ends without a result (cancelled, or the server is shutting down). This module
does not import the engine, so the HTTP side starts (and answers /health) while torch is still loading.
"""
from __future__ import annotations

import asyncio
import itertools
import threading

from flashdraft.server.requests import GenerationRequest

DELTA, RESULT, ERROR, ENDED = "delta", "result", "error", "ended"


class Job:
    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(Job._ids)
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.slot_id: int | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: str, payload) -> None:
        """Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass
