"""A request body that trickles in or never finishes (slowloris) is answered 408, not held forever.

The server runs under uvicorn on a real socket in this process with ``BODY_TIMEOUT_S`` lowered; a
client sends the headers and part of the body, then stalls. Before, nothing answered (uvicorn has no
body deadline): every such client held a connection and a task for as long as it liked. The answer
must be a 408 in the API's error shape, counted in ``m2serve_requests_total``, and a well-behaved
request right after must still be answered.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from serve_helpers import in_process_server

from m2serve.serve import api

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def server(tiny_random_dir):
    yield from in_process_server(tiny_random_dir)


@pytest.mark.parametrize("path, endpoint", [("/v1/chat/completions", "chat"), ("/v1/messages", "messages")])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_stalled_body_is_408_in_the_api_shape(server, monkeypatch, path, endpoint, framing):
    port, engine = server
    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.5)
    labels = {"endpoint": endpoint, "status": "408"}
    before = engine.metrics.registry.get_sample_value("m2serve_requests_total", labels) or 0.0
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if framing == "content-length":
        head = f"Content-Length: {len(BODY)}\r\n\r\n".encode()
        part = BODY[:10]
    else:
        head = b"Transfer-Encoding: chunked\r\n\r\n"
        part = b"a\r\n" + BODY[:10] + b"\r\n"
    request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    sock.sendall(request + head + part)
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)  # a socket timeout here: nothing answered the stalled body
        if not chunk:
            break
        answer += chunk
    sock.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"408", answer
    payload = json.loads(rest.partition(b"\r\n\r\n")[2])
    if path == "/v1/messages":
        assert payload["type"] == "error" and "did not arrive" in payload["error"]["message"], payload
    else:
        assert payload["error"]["code"] == "request_timeout" and "0.5 s" in payload["error"]["message"]
    assert engine.metrics.registry.get_sample_value("m2serve_requests_total", labels) == before + 1
    r = httpx.post(f"http://127.0.0.1:{port}{path}", content=BODY,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
