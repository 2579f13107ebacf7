"""scripts/walkthrough/client.py: the walkthrough's three prompts, its sampling, and the server's figures."""
import importlib.util
from pathlib import Path

from test_bench_server import serving, stub_app

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "walkthrough" / "client.py"


def load_client():
    spec = importlib.util.spec_from_file_location("walkthrough_client", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sends_the_walkthrough_requests_and_prints_the_servers_figures(capsys):
    client = load_client()
    app = stub_app()
    with serving(app) as url:
        assert client.main(["--url", url]) == 0
    bodies = [body for _, body in app.state.requests]
    assert [b["messages"][0]["content"] for b in bodies] == list(client.PROMPTS.values())
    assert all(b["max_tokens"] == 1200 and b["temperature"] == 0.7 and b["top_k"] == 64 and b["top_p"] == 0.95
               for b in bodies)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["prompt", "tokens", "tok/s", "drafted", "accepted", "rate", "prompt", "ms"]
    # the stub: 1200 tokens in 25 ms each (40 tok/s), 14 proposed and 6 accepted per 9 tokens, the prompt in 3 ms
    assert lines[1].split() == ["task-store", "1200", "40.0", str(14 * 1200 // 9), str(6 * 1200 // 9), "42.9%", "3.0"]
    assert lines[-1].split()[:3] == ["all", "3600", "40.0"] and lines[-1].split()[-1] == "9.0"


def test_an_error_reply_is_printed_and_fails(capsys):
    client = load_client()
    with serving(stub_app(fail=True)) as url:
        assert client.main(["--url", url]) == 1
    assert "HTTP 400" in capsys.readouterr().err
