"""Which of flashdraft's source files one streaming chat completion runs code in, in order of first visit: the
server on a loopback port over the embedded demo pair (CPU), a profiler on every thread, one greedy request after
a warm-up request. docs/architecture.md's request walk is this script's output.

    python scripts/cpu/request_walk.py
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx

import flashdraft
from flashdraft.demo import demo_paths
from flashdraft.server.cli import serve_in_thread
from flashdraft.server.settings import ServerSettings
from flashdraft.server.app import ServerState

ROOT = Path(flashdraft.__file__).parent


def main() -> int:
    visited: dict[str, None] = {}
    recording = threading.Event()

    def profile(frame, event, arg):
        if recording.is_set():
            path = frame.f_code.co_filename
            if path.startswith(str(ROOT)) and path not in visited:
                visited[path] = None

    # installed before any thread starts (the scheduler's, the server's), so every thread runs it
    threading.setprofile(profile)
    sys.setprofile(profile)
    target, drafter = demo_paths()
    state = ServerState(ServerSettings(model=str(target), drafter=str(drafter), alias=None, ctx_size=1024,
                                       n_predict=32, api_keys=[], device="cpu"))
    state.load(on_failure=lambda: None)
    server, base = serve_in_thread(state)
    url = base + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
            "stream": True, "max_tokens": 32, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        client.post(url, json=body).read()  # warm-up: lazy imports and first-use work are not the request's
        recording.set()
        client.post(url, json=body).read()
        recording.clear()
    sys.setprofile(None)
    threading.setprofile(None)
    server.handle_exit(15, None)
    for i, path in enumerate(visited, 1):
        print(f"{i:3d}  {Path(path).relative_to(ROOT)}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
