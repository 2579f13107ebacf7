"""The request-template sandbox's helper processes: one that died while idle is replaced, not blamed on the next
template; close() leaves no helper running, rendering ones included; descriptors past 1023 work."""
import os
import resource
import signal
import threading
import time

import pytest

from flashdraft.server.templates import TemplateError, TemplateSandbox

BOMB = "{% for i in range(100000) %}{% for j in range(100) %}{{ i }}{% endfor %}{% endfor %}"
HELLO = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
VARIABLES = {"messages": [{"role": "user", "content": "hi"}]}


def helpers(sandbox):
    return list(sandbox._idle) + list(sandbox._busy)


def test_a_helper_killed_while_idle_is_replaced():
    sandbox = TemplateSandbox(2.0)
    try:
        assert sandbox.render(HELLO, VARIABLES, 100, None) == "hi"
        (idle,) = sandbox._idle
        os.kill(idle.proc.pid, signal.SIGKILL)
        idle.proc.wait()
        assert sandbox.render(HELLO, VARIABLES, 100, None) == "hi"
        assert all(h.proc.poll() is None for h in helpers(sandbox))
    finally:
        sandbox.close()


def test_close_kills_rendering_helpers_and_starts_none():
    sandbox = TemplateSandbox(3.0)
    errors = []

    def render():
        try:
            sandbox.render(BOMB, {}, 10**9, None)
        except TemplateError as e:
            errors.append(str(e))

    thread = threading.Thread(target=render)
    thread.start()
    deadline = time.monotonic() + 10
    while not sandbox._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    procs = [h.proc for h in helpers(sandbox)]
    assert procs
    time.sleep(0.3)  # the bomb is rendering
    sandbox.close()
    thread.join(10)
    assert not thread.is_alive() and errors
    assert not helpers(sandbox) and all(p.poll() is not None for p in procs)
    with pytest.raises(TemplateError, match="shutting down"):
        sandbox.render(HELLO, VARIABLES, 100, None)


def test_pipes_past_descriptor_1023():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < 1200:
        pytest.skip(f"open files limited to {soft}")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    sandbox = TemplateSandbox(5.0)
    try:
        assert sandbox.render(HELLO, VARIABLES, 100, None) == "hi"
        assert helpers(sandbox)[0].proc.stdout.fileno() > 1023
    finally:
        sandbox.close()
        for fd in held:
            os.close(fd)
