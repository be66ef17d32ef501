"""SIGTERM with streams of every API in flight (issue 16 item 6), on the real server process.

Streams still running at the grace deadline were cut off (a truncated chunked body: no finish, no error
event, no ``[DONE]``) and each logged a ~50-line traceback. Now each ends in its API's shape: OpenAI
chat and completions an error event then ``data: [DONE]``; Anthropic Messages its ``error`` event;
Responses ``error`` then ``response.failed``; a non-streamed request a 503 body. One log line per
aborted request, no traceback, exit 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent
from serve_helpers import FAST_ENGINE_FLAGS, start_server

pytestmark = pytest.mark.slow  # starts server processes

GRACE_S = 2
LONG = 4000  # tokens: no stream can finish within the grace period
MESSAGES = [{"role": "user", "content": "Write a long story."}]
BODIES = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": LONG, "ignore_eos": True, "stream": True},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "stream": True},
    "/v1/messages": {"model": "m", "messages": MESSAGES, "max_tokens": LONG, "stream": True},
    "/v1/responses": {"input": "Write a long story.", "max_output_tokens": LONG, "stream": True},
}


def _read(url: str, body: dict, out: dict) -> None:
    """Read one response to its end in a thread: out gets 'status', 'lines' (non-empty SSE lines) and
    'body' (the non-streamed body); 'first' is set at the first event after the opening ones."""
    out["lines"] = []
    try:
        with httpx.Client(timeout=120) as h, h.stream("POST", url, json=body) as resp:
            out["status"] = resp.status_code
            if not body.get("stream"):
                out["body"] = json.loads(resp.read())
                return
            for line in resp.iter_lines():
                if line:
                    out["lines"].append(line)
                if len(out["lines"]) > 8:
                    out["first"].set()
    except httpx.HTTPError as e:  # a truncated body: what this test must never see
        out["error"] = repr(e)
    finally:
        out["first"].set()


def _events(lines: list[str]) -> list[tuple[str | None, str]]:
    """(event name or None, data) pairs of an SSE stream."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, line[6:]))
            name = None
    return out


def test_sigterm_ends_every_stream_in_its_api_shape(tiny_random_dir, tmp_path):
    server = start_server(["--model", str(tiny_random_dir), "--served-model-name", "m",
                           "--grace-period", str(GRACE_S), *FAST_ENGINE_FLAGS], tmp_path)
    try:
        jobs = [(route, body) for route, body in BODIES.items() for _ in range(5)]
        jobs.append(("/v1/chat/completions", {**BODIES["/v1/chat/completions"], "stream": False}))
        outs = [{"first": threading.Event()} for _ in jobs]
        outs[-1]["first"].set()  # not streamed: in flight once the streams (sent before it) are
        threads = [threading.Thread(target=_read, args=(server.url + route, body, out))
                   for (route, body), out in zip(jobs, outs, strict=True)]
        for t in threads:
            t.start()
        for out in outs:
            assert out["first"].wait(120)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(GRACE_S + 60)
        try:
            rc = server.proc.wait(GRACE_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after SIGTERM:\n{server.log()}") from None
    finally:
        server.stop()
    log = server.log()
    assert rc == 0, log
    ended = 0  # requests ended at the deadline (an Anthropic or Responses stream, which cannot ask for
    # ignore_eos, may have finished on its own before it: then it must have ended normally)
    for (route, body), out in zip(jobs, outs, strict=True):
        assert "error" not in out, (route, out.get("error"))
        assert out["status"] == (200 if body["stream"] else 503), (route, out)
        if not body["stream"]:
            assert out["body"]["error"]["code"] == "server_shutdown", out["body"]
            ended += 1
            continue
        events = _events(out["lines"])
        if route in ("/v1/chat/completions", "/v1/completions"):  # ignore_eos: always cut
            assert events[-1] == (None, "[DONE]"), (route, events[-3:])
            err = json.loads(events[-2][1])["error"]
            assert err["code"] == "server_shutdown" and "grace period" in err["message"]
            ended += 1
        elif route == "/v1/messages":
            assert events[0][0] == "message_start"
            name, data = events[-1]
            if name == "message_stop":
                assert events[-2][0] == "message_delta"
                continue
            assert name == "error" and json.loads(data)["error"]["type"] == "overloaded_error", events[-3:]
            assert "grace period" in json.loads(data)["error"]["message"]
            ended += 1
        else:
            name, data = events[-1]
            if name == "response.completed":
                continue
            assert (events[-2][0], name) == ("error", "response.failed"), (route, events[-3:])
            error = ResponseErrorEvent.model_validate_json(events[-2][1])  # the SDK's own event types
            failed = ResponseFailedEvent.model_validate_json(data).response
            assert error.code == "server_shutdown" and "grace period" in error.message
            assert failed.status == "failed" and failed.error.code == "server_error"
            ended += 1
    assert ended >= 11
    assert "Traceback" not in log, log
    aborted = [line for line in log.splitlines() if "aborted: the server is shutting down" in line]
    assert len(aborted) == ended, log
    print(f"{ended} of {len(jobs)} requests ended at the grace deadline")
