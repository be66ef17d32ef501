"""Intra-op threads: one rule for every entry point (docs/serving.md §12).

The rule (``choose_num_threads``) is checked against hand-set cases and the physical-core count
against ``lscpu``'s topology; then the real processes — ``m2serve serve``, ``m2serve generate`` and
a Python ``LLM`` — read ``torch.get_num_threads()`` back after start-up (the banner prints the value
read back), and so do the CPU ranks of a ``cpu:2`` group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from serve_helpers import start_server

from m2serve.config.engine_args import EngineArgs, choose_num_threads, physical_cores
from m2serve.parallel.launch import run_ranks

pytestmark = pytest.mark.slow  # starts server processes

EXE = str(Path(sys.executable).with_name("m2serve"))
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ["--dtype", "float32", "--kv-cache-page-size", "16", "--num-kv-pages", "32"]


def _env(**extra: str) -> dict[str, str]:
    """The environment of an entry-point process: no OMP_NUM_THREADS, no M2SERVE_* settings."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("M2SERVE_")}
    env.update(extra)
    return env


def _lscpu_cores() -> int:
    """Independent count: distinct (core, socket) pairs of lscpu's CPU list, for the CPUs this
    process may use."""
    out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    mine = os.sched_getaffinity(0)
    rows = [line.split(",") for line in out.splitlines() if line and not line.startswith("#")]
    return len({(core, sock) for cpu, core, sock in rows if int(cpu) in mine})


def test_rule_cases():
    cores = physical_cores()
    assert choose_num_threads(EngineArgs(devices="cpu"), {}).threads == cores
    assert choose_num_threads(EngineArgs(devices="cpu", threads=3), {"OMP_NUM_THREADS": "2"}).threads == 3
    assert choose_num_threads(EngineArgs(devices="cpu"), {"OMP_NUM_THREADS": "2"}).threads == 2
    assert choose_num_threads(EngineArgs(devices="cpu:4"), {}).threads == 1      # one per rank
    assert choose_num_threads(EngineArgs(devices="cpu:4", threads=2), {}).threads == 2
    torchrun = {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    assert choose_num_threads(EngineArgs(devices="cpu"), torchrun).threads == 1  # 2 ranks on this node
    assert choose_num_threads(EngineArgs(devices="gpu"), {}).threads is None      # torch default kept
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        choose_num_threads(EngineArgs(threads=0), {})


def test_physical_cores_match_lscpu():
    quota = Path("/sys/fs/cgroup/cpu.max")
    limited = quota.is_file() and not quota.read_text().startswith("max")
    if limited:
        assert 1 <= physical_cores() <= _lscpu_cores()
    else:
        assert physical_cores() == _lscpu_cores()


def test_python_llm_reads_back_the_rule():
    code = ("import torch; from m2serve.serve.llm import LLM; "
            "llm = LLM(None, dtype='float32', kv_cache_page_size=16, num_kv_pages=32); "
            "print('THREADS', torch.get_num_threads(), llm.threads.rule)")
    for env, want in ((_env(), physical_cores()), (_env(OMP_NUM_THREADS="1"), 1)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        n, rule = re.search(r"THREADS (\d+) (.+)", r.stdout).groups()
        omp = {k: v for k, v in env.items() if k == "OMP_NUM_THREADS"}
        assert int(n) == want == choose_num_threads(EngineArgs(devices="cpu"), omp).threads
        assert rule == ("physical cores" if want == physical_cores() and "OMP_NUM_THREADS" not in env
                        else "OMP_NUM_THREADS")


def _banner_threads(text: str) -> tuple[int, str]:
    n, rule = re.search(r"\| threads (\d+) intra-op \(([^)]*)\) \|", text).groups()
    return int(n), rule


def test_generate_banner_reads_back_the_rule():
    r = subprocess.run([EXE, "generate", *SMALL, "--max-tokens", "1", "hi"], capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert _banner_threads(r.stderr) == (physical_cores(), "physical cores")
    r = subprocess.run([EXE, "generate", *SMALL, "--threads", "1", "--max-tokens", "1", "hi"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert _banner_threads(r.stderr) == (1, "--threads")


def test_server_banner_reads_back_the_rule(tmp_path):
    server = start_server([*SMALL], tmp_path, env={"OMP_NUM_THREADS": ""})
    try:
        assert _banner_threads(server.log()) == (physical_cores(), "physical cores")
    finally:
        server.stop()


def test_bad_thread_count_is_a_usage_error():
    r = subprocess.run([EXE, "generate", *SMALL, "--threads", "0", "hi"], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 2 and "threads=0 must be >= 1" in r.stderr


def _rank_threads(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


def test_cpu_ranks_get_one_thread_each(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    want = choose_num_threads(EngineArgs(devices="cpu:2"), {}).threads
    assert want == 1
    assert run_ranks(_rank_threads, 2, timeout_s=60) == [want, want]
    code = ("import torch; from m2serve.serve.llm import LLM; "
            "llm = LLM(None, dtype='float32', devices='cpu:2', kv_cache_page_size=16, num_kv_pages=32); "
            "print('THREADS', torch.get_num_threads(), llm.threads.rule)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"THREADS (\d+) (.+)", r.stdout).groups() == ("1", "one per rank, 2 CPU ranks")


def test_benchmarks_keep_their_threads_flag():
    """benchmarks/speculative.py and tiny_chat_eval.py build an LLM, whose thread rule would replace
    their --threads by one per physical core; the count they print is read back after the model is
    built. N = physical cores + 1, so the rule's own choice cannot pass for it."""
    n = physical_cores() + 1
    src = str(BENCH.parent / "src")
    runs = {"speculative.py": ["--per-kind", "1", "--repeats", "1", "--batches", "1", "--kinds", "plain",
                               "--max-tokens", "8"],
            "tiny_chat_eval.py": ["--per-kind", "1", "--kinds", "plain", "--show-failures", "0"]}
    for script, extra in runs.items():
        r = subprocess.run([sys.executable, script, "--threads", str(n), *extra], capture_output=True,
                           text=True, env=_env(PYTHONPATH=src), cwd=BENCH, timeout=300)
        assert r.returncode == 0, r.stderr
        assert re.findall(r"threads (\d+)", r.stdout) == [str(n)], (script, r.stdout)
