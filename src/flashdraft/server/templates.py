"""Chat templates sent by requests (only with --allow-request-chat-template), rendered in a helper process.

A template is a program. jinja2's ImmutableSandboxedEnvironment keeps it from reaching the server's objects,
but not from running for minutes (nested loops) or from asking for gigabytes in one string operation, and a
thread cannot be stopped from outside. So templates run in a separate process, in that sandbox, with its
address space capped; the process is killed when the time limit passes or the client leaves, and a fresh one
starts for the next template. Run as `python -m flashdraft.server.templates`, it is that process: one JSON
request a line on stdin, one JSON reply a line on stdout.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time

MEMORY_BYTES = 256 * 1024 * 1024  # address space a rendering may add to the helper's own
POLL_SECONDS = 0.02               # how often a waiting renderer looks at its request's cancel flag
START_SECONDS = 30                # a helper's start (Python, jinja2) is not counted in a rendering's time


class TemplateError(Exception):
    """The template failed, ran out of time or memory, or its client left; the message says which."""


class TemplateBusy(Exception):
    """Every helper process is rendering and none freed up in time."""


class TemplateSandbox:
    """Renders request templates in up to `workers` helper processes, each rendering at most `seconds`."""

    def __init__(self, seconds: float, workers: int = 2):
        self.seconds = seconds
        self._idle: list[_Helper] = []
        self._busy: set[_Helper] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._free = threading.BoundedSemaphore(workers)

    def warm(self) -> None:
        """Start one helper ahead of the first request (a start takes a few tenths of a second)."""
        with self._lock:
            if not self._idle and not self._closed:
                self._idle.append(_Helper())

    def render(self, template: str, variables: dict, max_chars: int, cancelled: threading.Event | None) -> str:
        if not self._free.acquire(timeout=self.seconds):
            raise TemplateBusy("every chat template helper is busy; try again")
        try:
            reply = self._ask({"template": template, "variables": variables, "max_chars": max_chars}, cancelled)
        finally:
            self._free.release()
        if "error" in reply:
            raise TemplateError(reply["error"])
        return reply["text"]

    def _ask(self, request: dict, cancelled: threading.Event | None) -> dict:
        """One rendering on an idle helper; one that died while it waited (OOM killer, a signal) is replaced
        once, so its death is not blamed on this request's template. Any failure kills the helper."""
        for attempt in range(2):
            with self._lock:
                if self._closed:
                    raise TemplateError("the server is shutting down")
                helper = self._idle.pop() if self._idle else _Helper()
                self._busy.add(helper)
            try:
                reply = helper.ask(request, self.seconds, cancelled)
            except _HelperGone:
                helper.kill()
                if attempt == 0:
                    continue
                raise TemplateError("the chat template helper process failed") from None
            except BaseException:
                helper.kill()
                if self._closed:  # close() ended the process under this rendering
                    raise TemplateError("the server is shutting down") from None
                self.warm()  # the next template need not wait for a start
                raise
            finally:
                with self._lock:
                    self._busy.discard(helper)
            with self._lock:
                if self._closed:
                    helper.kill()
                else:
                    self._idle.append(helper)
            return reply

    def close(self) -> None:
        """Kill every helper, rendering or idle; renderings under way fail, and no helper starts again. A
        rendering helper's pipes are left to the thread reading them (closing a descriptor another thread is
        reading fails that read, or worse, lets it read whatever file reuses the number)."""
        with self._lock:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
        for helper in idle:
            helper.kill()
        for helper in busy:
            helper.proc.kill()


class _HelperGone(Exception):
    """A helper that was idle could not take a request: it had died."""


class _Helper:
    """One helper process and the pipes to it."""

    def __init__(self):
        # A session of its own: a Ctrl+C meant for the server does not reach it (the server kills it on close).
        self.proc = subprocess.Popen([sys.executable, "-m", "flashdraft.server.templates"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.ready = False  # the process writes one line when it is ready
        self._lock = threading.Lock()

    def ask(self, request: dict, seconds: float, cancelled: threading.Event | None) -> dict:
        """Send one request and wait for its reply, at most `seconds` (after the start) or until `cancelled`."""
        if not self.ready:
            self._line(START_SECONDS, cancelled, "starting the chat template helper")
            self.ready = True
        if self.proc.poll() is not None:
            raise _HelperGone()
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise _HelperGone() from None
        return json.loads(self._line(seconds, cancelled, "rendering"))

    def _line(self, seconds: float, cancelled: threading.Event | None, doing: str) -> bytes:
        deadline = time.monotonic() + seconds
        fd, data = self.proc.stdout.fileno(), b""
        with selectors.DefaultSelector() as selector:  # poll/epoll: select() fails on descriptors past 1023
            selector.register(fd, selectors.EVENT_READ)
            while not data.endswith(b"\n"):
                if cancelled is not None and cancelled.is_set():
                    raise TemplateError(f"the client closed the request while {doing}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TemplateError(f"{doing} took longer than the limit of {seconds:g} s")
                if selector.select(min(left, POLL_SECONDS)):
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        raise TemplateError(f"the helper process ended while {doing} (out of memory?)")
                    data += chunk
        return data

    def kill(self) -> None:
        """Kill the process and close its pipes; safe to call twice and on a process that already died (a
        write it never read stays in stdin's buffer, and closing that pipe would raise BrokenPipeError)."""
        with self._lock:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


# --- the helper process -------------------------------------------------------------------------------------


def _environment():
    """The sandbox with what transformers gives chat templates (raise_exception, tojson, strftime_now, ...)."""
    from datetime import datetime

    import jinja2.ext
    from jinja2.exceptions import SecurityError, TemplateError as JinjaTemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    def raise_exception(message):
        raise JinjaTemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class SafeNamespace(Namespace):
        """No underscore attributes: they lead to the interpreter's internals."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"namespace attribute {name!r} starts with an underscore")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       namespace=SafeNamespace)
    return env


def _cap_memory() -> None:
    """Cap the address space at what the process uses now plus MEMORY_BYTES (Linux; elsewhere only the time
    limit holds)."""
    try:
        import resource
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + MEMORY_BYTES, used + MEMORY_BYTES))
    except (ImportError, OSError, ValueError):
        pass


def _render(env, compiled: dict, request: dict) -> dict:
    source = request["template"]
    if source not in compiled:
        if len(compiled) > 16:
            compiled.clear()
        compiled[source] = env.from_string(source)
    text = compiled[source].render(**request["variables"])
    if len(text) > request["max_chars"]:
        return {"error": f"the rendered prompt has {len(text)} characters, over the limit of {request['max_chars']}"}
    return {"text": text}


def main() -> None:
    env = _environment()
    _cap_memory()
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    compiled: dict = {}
    for line in sys.stdin.buffer:
        try:
            reply = _render(env, compiled, json.loads(line))
        except Exception as e:  # whatever the template did (MemoryError, RecursionError, ...), the reply says it
            reply = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        try:
            out = json.dumps(reply).encode()
        except MemoryError:
            out = b'{"error": "MemoryError"}'
        sys.stdout.buffer.write(out + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
