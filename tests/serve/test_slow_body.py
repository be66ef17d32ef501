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
import threading
import time

import httpx
import pytest
import uvicorn
from serve_helpers import free_port

from m2serve.serve import api
from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def server(tiny_random_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(tiny_random_dir), "--dtype", "float32", "--num-kv-pages", "64",
            "--kv-cache-page-size", "16"]
    engine = AsyncEngine(_make_llm(resolve_options(parser.parse_args(argv), parser, {})))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, ServerSettings(served_model_name="m")),
                                        host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield port, engine
    srv.should_exit = True
    thread.join(30)


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
