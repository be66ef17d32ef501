"""Building the kernels: once per cache under a file lock, the fallback reason, the CLI subcommand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from m2serve.kernels import build
from m2serve.serve.cli import main as cli_main


@pytest.mark.slow
def test_concurrent_ranks_build_once(tmp_path):
    # two processes start on an empty cache at once (like cpu:2 ranks): one compiles, the other waits
    env = {**os.environ, build.CACHE_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = "from m2serve.kernels.build import kernel_backend; print(kernel_backend().name)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(err.count("building CPU kernels (once)") for _, err in outs) == 1
    assert all(out.strip().startswith("cpu-") for out, _ in outs)


def test_missing_compiler_falls_back_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    reason = build.load_library.__wrapped__()
    assert reason is not None and "no C++ compiler" in reason and "/nonexistent/c++" in reason


def test_build_kernels_subcommand(capsys):
    assert cli_main(["build-kernels"]) == 0
    assert "CPU linear backend: cpu-" in capsys.readouterr().out
