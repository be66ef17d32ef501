"""Backpressure and shutdown of the real server process (issue 5 items 2–3).

One server with one running slot (--max-batch-size 1) and a waiting queue of one (--max-queue-size 1):
a third concurrent request gets 503 + Retry-After; then SIGTERM lets the in-flight stream finish,
ends the one still running when the grace period ends (an error event, then [DONE]), and the process
exits 0. The SIGTERM
test stops the server, so it runs last.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, metric, start_server

pytestmark = pytest.mark.slow  # starts server processes

GRACE_S = 6  # short enough that B (4000 tokens) cannot finish on a fast, quiet machine
MESSAGES = [{"role": "user", "content": "Write a long story."}]


@pytest.fixture(scope="module")
def server(tiny_random_dir, tmp_path_factory):
    s = start_server(
        [
            "--model",
            str(tiny_random_dir),
            "--max-batch-size",
            "1",
            "--max-queue-size",
            "1",
            "--grace-period",
            str(GRACE_S),
            *FAST_ENGINE_FLAGS,
        ],
        tmp_path_factory.mktemp("limits"),
    )
    yield s
    s.stop()


def _wait_for(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _first_token(resp: httpx.Response):
    """Iterate SSE lines until a chunk with generated text; returns the line iterator."""
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and (
                choices[0]["delta"].get("reasoning_content") or choices[0]["delta"].get("content")
            ):
                return lines
    raise AssertionError("stream ended before any token")


def test_full_queue_503_retry_after(server):
    # issue 5 item 2: 503 with Retry-After when the waiting queue (--max-queue-size) is full
    long = {"messages": MESSAGES, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", url, json=long) as ra:
            lines_a = _first_token(ra)  # A runs (the only slot)
            with b.stream("POST", url, json=long) as rb:
                assert rb.status_code == 200  # B is accepted and waits
                assert _wait_for(lambda: metric(server.metrics(), "m2serve_num_requests_waiting") == 1)
                rc = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
                assert rc.status_code == 503, rc.text
                assert int(rc.headers["retry-after"]) >= 1
                err = rc.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert "max-queue-size" in err["message"] and err["code"] == "queue_full"
                next(lines_a)  # A is unaffected and still streaming
    # both clients left: their requests are aborted and the pages come back
    assert _wait_for(
        lambda: (
            metric(m := server.metrics(), "m2serve_num_requests_running") == 0
            and metric(m, "m2serve_num_requests_waiting") == 0
            and metric(m, "m2serve_kv_pages_used") == 0
        )
    )
    r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def _consume(url: str, body: dict, out: dict) -> None:
    """Read one SSE stream to its end in a thread; out gets 'lines', 'first' (event) and 'error'."""
    out["lines"] = []
    try:
        with httpx.Client(timeout=120) as h, h.stream("POST", url, json=body) as resp:
            out["accepted"].set()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line)
                    if '"reasoning_content"' in line or '"content": "' in line:
                        out["first"].set()
    except httpx.HTTPError as e:  # the connection closed mid-stream (request aborted at shutdown)
        out["error"] = e


def test_sigterm_finishes_inflight_aborts_after_grace_exits_0(server):
    # issue 5 item 3: SIGTERM stops accepting, lets in-flight requests finish within the grace
    # period, aborts what is left after it, and exits 0
    url = server.url + "/v1/chat/completions"
    short = {
        "messages": MESSAGES,
        "max_tokens": 10,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    long = {"messages": MESSAGES, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    a = {"first": threading.Event(), "accepted": threading.Event()}
    b = {"first": threading.Event(), "accepted": threading.Event()}
    ta = threading.Thread(target=_consume, args=(url, short, a))
    tb = threading.Thread(target=_consume, args=(url, long, b))
    ta.start()
    assert a["first"].wait(60)
    tb.start()  # waits behind A (one running slot), runs after A, cannot finish within the grace period
    assert b["accepted"].wait(60)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.ConnectError):  # no longer accepting connections
        httpx.get(server.url + "/health", timeout=5)
    ta.join(GRACE_S + 30)
    tb.join(GRACE_S + 30)
    assert a["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in a["lines"][:-1]]
    finishes = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0].get("finish_reason")
    ]
    assert finishes == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 10  # A ran to its end
    # B was ended at the grace deadline, in the stream's own shape (issue 16 item 6): an error event, [DONE]
    assert "error" not in b and b["lines"][-1] == "data: [DONE]", b
    assert json.loads(b["lines"][-2][6:])["error"]["code"] == "server_shutdown"
    try:
        rc = server.proc.wait(GRACE_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running {GRACE_S + 30} s after SIGTERM:\n{server.log()}")
    assert rc == 0, server.log()
    assert GRACE_S - 1 < time.monotonic() - t0 < GRACE_S + 30
