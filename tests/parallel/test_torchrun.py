"""Multi-node on one machine: torchrun, 2 nodes x 2 CPU processes on 127.0.0.1 (world size 4),
env:// rendezvous; greedy output equals one process (issue 8 "must show", docs/parallelism.md §1, V5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m2serve.engine.core import LLMEngine
from m2serve.parallel.launch import free_port

pytestmark = pytest.mark.slow  # starts several rank processes

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_greedy import engine_args, greedy  # noqa: E402

SCRIPT = Path(__file__).with_name("torchrun_greedy.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_torchrun_two_nodes_two_procs_equals_one_process(tiny_random_dir, tmp_path):
    port = free_port()
    out = tmp_path / "tokens.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT), str(tiny_random_dir),
         "4", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for n in range(2)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(logs)[-4000:]
    got = json.loads(out.read_text())
    assert got["world"] == 4 and got["mode"] == "TP_EP"  # ep_size 4 over 2 nodes x 2 processes
    want = greedy(LLMEngine.from_args(engine_args(str(tiny_random_dir))))
    assert got["tokens"] == want and all(len(t) == 32 for t in want)
