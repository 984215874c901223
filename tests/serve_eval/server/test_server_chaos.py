"""Chaos: the real server process (`python -m draftsmith.serve_eval.server.run`) gets SIGTERM while it
streams; every stream ends with a terminal event, the process exits, and a restart serves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from draftsmith.serve_eval.server.testing import build_tiny_checkpoint, free_loopback_socket

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory):
    # Wide and long enough that a long greedy stream is still running when the signal arrives.
    return build_tiny_checkpoint(tmp_path_factory.mktemp("chaos_llama"), num_layers=4,
                                 hidden_size=256, max_position=2048)


def start_server(model_dir: Path, grace_s: float) -> tuple[subprocess.Popen, str]:
    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.serve_eval.server.run", "--model", str(model_dir), "--port", str(port),
         "--shutdown-grace-s", str(grace_s), "--num-gpu-blocks", "512", "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited at start:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not come up")


def stream_events(base_url: str, out: list, started: threading.Event) -> None:
    body = {"prompt": "hello world", "max_tokens": 1900, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:   # a cut connection is what the test must not see
        out.append(f"transport error: {exc!r}")
    finally:
        started.set()


def test_sigterm_mid_stream_ends_every_stream_and_a_restart_serves(slow_ckpt):
    proc, base_url = start_server(slow_ckpt, grace_s=0.5)
    try:
        results: list[list[str]] = [[] for _ in range(3)]
        started = [threading.Event() for _ in results]
        workers = [threading.Thread(target=stream_events, args=(base_url, out, ev))
                   for out, ev in zip(results, started)]
        for worker in workers:
            worker.start()
        for ev in started:
            assert ev.wait(60)
        proc.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.join(60)
            assert not worker.is_alive(), "a stream hung after SIGTERM"
        assert proc.wait(60) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] in ("abort", "length"), final
    proc, base_url = start_server(slow_ckpt, grace_s=0.5)
    try:
        again = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
