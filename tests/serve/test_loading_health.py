"""/health while the model loads (issue 26 item 7, docs/serving.md §12): the server answers from the
start, ``/health`` 503 ``{"status": "loading"}`` and every other route a 503 in its API's shape, until the
loader returns; a loader that fails is reported, not hidden. The loader here blocks on an event."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_loading_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options
from m2serve.serve.metrics import ServerMetrics

CHAT = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}


def _llm(model_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(model_dir), "--dtype", "float32", "--num-kv-pages", "32",
            "--kv-cache-page-size", "16"]
    return _make_llm(resolve_options(parser.parse_args(argv), parser, {}))


def test_health_is_loading_until_the_loader_returns(tiny_random_dir):
    release, metrics, built = threading.Event(), ServerMetrics(), []

    def load():
        assert release.wait(60)
        built.append(_llm(tiny_random_dir))
        return AsyncEngine(built[0], metrics), ServerSettings(served_model_name="m", api_key="k")

    app = build_loading_app(load, "k", metrics, 2**20)
    auth = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        h = client.get("/health")
        assert (h.status_code, h.json()) == (503, {"status": "loading"})
        assert h.headers["retry-after"] == "1"
        r = client.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "model_loading" and "loading" in r.json()["error"]["message"]
        a = client.post("/v1/messages", json={**CHAT, "max_tokens": 1}, headers=auth)
        assert a.status_code == 503 and a.json()["type"] == "error"
        assert a.json()["error"]["type"] == "overloaded_error"
        assert client.get("/v1/models", headers=auth).status_code == 503
        assert client.get("/metrics").status_code == 503
        release.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        assert client.get("/health").json() == {"status": "ok"}
        # the KV gauges are set at start-up, not at the first step (issue 26 item 8)
        gauges = dict(line.rsplit(" ", 1) for line in client.get("/metrics").text.splitlines()
                      if line.startswith("m2serve_kv_pages"))
        assert float(gauges["m2serve_kv_pages_free"]) == built[0].engine.stats.kv_pages_total == 32
        assert float(gauges["m2serve_kv_pages_used"]) == 0
        ok = client.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 401  # the key applies


def test_a_failed_load_stops_the_server_with_its_error():
    stopped = threading.Event()

    def load():
        raise ValueError("config.json: no such file")

    app = build_loading_app(load, None, ServerMetrics(), 2**20, on_load_error=stopped.set)
    with TestClient(app) as client:
        assert stopped.wait(30)
        assert isinstance(app.state.load_error, ValueError)
        assert client.get("/health").json() == {"status": "loading"}  # it never became ready
