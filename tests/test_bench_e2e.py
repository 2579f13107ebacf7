"""`flashdraft bench --url` against two real `flashdraft serve` processes (tiny model, loopback): the same
report shape as the in-process run, and greedy DFlash output identical to plain decoding's."""
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from flashdraft.bench.cli import main
from test_bench_cli import ROW_KEYS, SUMMARY_KEYS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(qwen3_dir, drafter_dir, tmp_path_factory):
    """(url with DFlash, url without a drafter), each a `flashdraft serve` process."""
    logs = tmp_path_factory.mktemp("serve-logs")
    procs, urls = [], []
    # The random drafter never pays, so the adaptive controller could stop drafting: draft every step instead.
    for name, extra in (("dflash", ["-md", str(drafter_dir), "--no-spec-dm-adaptive"]), ("plain", [])):
        port = free_port()
        log = open(logs / f"{name}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(qwen3_dir), *extra, "--host", "127.0.0.1",
             "--port", str(port), "-c", "256", "-t", "1", "--device", "cpu"],
            stdout=log, stderr=subprocess.STDOUT), log, logs / f"{name}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        for (proc, _, log_path), url in zip(procs, urls):
            while not healthy(url):
                if proc.poll() is not None:
                    pytest.fail(f"flashdraft serve exited ({proc.returncode}):\n{log_path.read_text()[-2000:]}")
                assert time.monotonic() < deadline, f"flashdraft serve not ready:\n{log_path.read_text()[-2000:]}"
                time.sleep(0.5)
        yield urls
    finally:
        for proc, _, _ in procs:  # both at once: each takes a while to exit
            proc.terminate()
        for proc, log, _ in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"name": "chat", "messages": [{"role": "user", "content": "Hi"}]}) + "\n"
                    + json.dumps({"name": "raw", "prompt": "def add(a, b):"}) + "\n")
    return str(path)


def bench(capsys, argv):
    code = main(argv + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def check_report(report):
    assert [r["name"] for r in report["prompts"]] == ["chat", "raw"]
    for row in report["prompts"]:
        assert set(row) == ROW_KEYS
        assert row["identical"] is True
        assert row["baseline_tok_s"] > 0 and row["dflash_tok_s"] > 0 and row["tau"] >= 1.0
        assert row["draft_n"] > 0 and row["draft_lengths"] is None  # servers do not report the lengths
    assert set(report["summary"]) == SUMMARY_KEYS and report["config"]["mode"] == "server"


def test_two_servers(capsys, servers, prompts):
    url, baseline_url = servers
    check_report(bench(capsys, ["--url", url, "--baseline-url", baseline_url, "-n", "6", "--prompts", prompts]))


def test_one_server_with_per_request_baseline(capsys, servers, prompts):
    check_report(bench(capsys, ["--url", servers[0], "-n", "6", "--prompts", prompts, "--reps", "2"]))
