"""Test helpers for the serve tests: start the real ``m2serve serve`` process on a free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent

# Small, fast engine settings shared by the e2e servers (fp32 compute: faster than bf16 on CPU).
FAST_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-page-size",
    "16",
    "--num-kv-pages",
    "512",
    "--max-batch-input-tokens",
    "2048",
    "--log-level",
    "warning",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running server subprocess: its base URL, Popen handle and captured log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Parse /metrics into {'name{labels}': value} (comments dropped)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(
    args: list[str],
    tmp_dir: Path,
    env: dict[str, str] | None = None,
    entry: list[str] | None = None,
    timeout: float = 300.0,
) -> ServerProcess:
    """Start ``m2serve serve ARGS --port P`` (or a test-only ``entry`` script) and wait for /health."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    cmd = (entry or [sys.executable, "-m", "m2serve.serve.cli"]) + [
        "serve",
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(url, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.log()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout:.0f} s:\n{server.log()}")


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Value of one sample (0 when absent); labels matched exactly as prometheus prints them."""
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return m.get(f"{name}{{{inner}}}", 0.0)
    return m.get(name, 0.0)


def labels_of(key: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', key))


# A structured-output schema whose every production is bounded (enum, boolean, integer bounds, a string
# with maxLength): the embedded model's greedy output always completes it within 256 tokens.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "sky": {"enum": ["sunny", "cloudy", "rainy"]},
        "warm": {"type": "boolean"},
        "celsius": {"type": "integer", "minimum": -30, "maximum": 45},
    },
    "required": ["city", "sky", "warm", "celsius"],
    "additionalProperties": False,
}


def in_process_server(model_dir: Path | str):
    """Yield (port, AsyncEngine) of `m2serve serve` over ``model_dir`` (fp32, 64 pages of 16 tokens)
    run by uvicorn in a thread of this process, so tests can patch the routes; stops it after."""
    import threading

    import uvicorn

    from m2serve.serve.api import ServerSettings, build_app
    from m2serve.serve.async_engine import AsyncEngine
    from m2serve.serve.cli import _make_llm, build_parser, resolve_options

    parser = build_parser()
    argv = ["serve", "--model", str(model_dir), "--dtype", "float32", "--num-kv-pages", "64",
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
