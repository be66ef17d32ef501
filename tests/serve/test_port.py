"""A taken port fails before the model loads (docs/serving.md §12): the listening socket is bound
first and handed to uvicorn, so there is no window between a check and the bind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_helpers import start_server

pytestmark = pytest.mark.slow  # starts server processes

EXE = str(Path(sys.executable).with_name("m2serve"))
SMALL = ["--dtype", "float32", "--kv-cache-page-size", "16", "--num-kv-pages", "32"]
LOADING = "loading model"


def test_taken_port_exits_before_loading(tmp_path):
    # a server at the default log level (info) on a free port: it logs the loading line and the banner
    first = start_server([*SMALL, "--log-level", "info"], tmp_path)
    try:
        port = int(first.url.rsplit(":", 1)[1])
        log = first.log()
        assert LOADING in log and f"| http://127.0.0.1:{port}/v1" in log
        # a second server on the same (listening) port fails before it loads anything
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run([EXE, "serve", *SMALL, "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, env=env, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out
        assert f"port {port} in use" in out
        assert LOADING not in out and "/v1" not in out and "intra-op" not in out, out  # no load, no banner
        assert httpx.get(first.url + "/health").status_code == 200  # the holder is untouched
    finally:
        first.stop()
