"""The catch-all (issue 26 item 4): an uncaught error in a route is a JSON 500 in the API's shape.

A failure is injected into a route (its request builder raises), and the server, run by uvicorn on a
real socket in this process, must answer a 500 in the error shape of the API called, log it in the
access log with status 500, count it in ``m2serve_requests_total``, and keep the HTTP/1.1 connection
open (a second request goes over the same socket). Before, the answer was a plain-text ``Internal
Server Error``, the connection was dropped, the access log said status 0 and nothing was counted.
A stream cut by such an error ends with an error event in its API's stream shape.
"""

from __future__ import annotations

import http.client
import json
import logging
import time

import pytest
from serve_helpers import in_process_server

from m2serve.serve.anthropic import messages
from m2serve.serve.openai import chat, responses

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_random_dir):
    yield from in_process_server(tiny_random_dir)


def _boom(*args, **kwargs):
    raise RuntimeError("injected failure")


def _requests_total(engine, endpoint: str, status: str) -> float:
    labels = {"endpoint": endpoint, "status": status}
    return engine.metrics.registry.get_sample_value("m2serve_requests_total", labels) or 0.0


@pytest.mark.parametrize("path, body, target, endpoint", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}, (chat, "chat_job"), "chat"),
    ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 1}, (messages, "messages_job"),
     "messages"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}, (responses, "responses_job"), "responses"),
])
def test_uncaught_error_is_a_json_500_and_the_connection_stays(server, monkeypatch, caplog, path, body,
                                                                target, endpoint):
    port, engine = server
    before = _requests_total(engine, endpoint, "500")
    monkeypatch.setattr(*target, _boom)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    caplog.set_level(logging.WARNING, logger="m2serve.access")
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = json.loads(r.read())
    assert r.status == 500 and r.getheader("content-type") == "application/json"
    if path == "/v1/messages":
        assert payload["type"] == "error" and payload["error"]["type"] == "api_error", payload
    else:
        assert payload["error"]["type"] == "server_error" and payload["error"]["code"] == 500, payload
    assert "RuntimeError" in json.dumps(payload)
    assert not r.will_close  # no "Connection: close"
    # the access line is written once the response is sent: wait for it (the server runs in a thread)
    deadline = time.monotonic() + 10
    while not any(f"POST {path} 500 " in rec.getMessage() for rec in caplog.records):
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.02)
    assert _requests_total(engine, endpoint, "500") == before + 1
    # the same socket answers the next request
    sock = conn.sock
    monkeypatch.undo()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r2 = conn.getresponse()
    r2.read()
    assert r2.status == 200 and conn.sock is sock
    conn.close()


def test_a_stream_cut_by_an_uncaught_error_ends_with_an_error_event(server, monkeypatch):
    port, _ = server

    async def broken_stream(*args, **kwargs):
        yield "data: {}\n\n"
        raise RuntimeError("injected failure")

    monkeypatch.setattr(messages, "_stream", broken_stream)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "m", "messages": USER, "max_tokens": 1, "stream": True}
    conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1].startswith("event: error\ndata: "), text
    err = json.loads(frames[-1].split("data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    monkeypatch.undo()
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": False}),
                 {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()

