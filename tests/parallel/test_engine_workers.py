"""The engine on ``--devices cpu:2`` (spawned workers) and a killed worker (issue 8 item 2).

The scenario runs in a child process: the engine process joins the process group as rank 0,
which the pytest process should not do.
"""

from __future__ import annotations

import signal
import time
import traceback

import pytest
from rank_helpers import spawn_scenario

from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams
from m2serve.parallel.launch import WorkerError

pytestmark = pytest.mark.slow  # starts several rank processes

PROMPT = [5, 17, 33, 2, 8, 90, 1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _generate(engine: LLMEngine, rid: str) -> list[int]:
    engine.add_request(rid, PROMPT, GREEDY)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def _scenario(ckpt: str, results) -> None:
    try:
        base = dict(model=ckpt, dtype="float32", kv_cache_format="float32", num_kv_pages=16,
                    kv_cache_page_size=16)
        one = _generate(LLMEngine.from_args(EngineArgs(**base)), "ref")
        engine = LLMEngine.from_args(EngineArgs(**base, devices="cpu:2"))
        model = engine.runner.model
        two = _generate(engine, "a")
        worker = model.workers.procs[0]
        worker.kill()  # SIGKILL rank 1 while the engine is idle
        t0 = time.monotonic()
        try:
            _generate(engine, "b")
            err = None
        except WorkerError as e:
            err = str(e)
        elapsed = time.monotonic() - t0
        model.shutdown()
        results.put({"one": one, "two": two, "err": err, "elapsed": elapsed, "pid": worker.pid})
    except BaseException:
        results.put({"crash": traceback.format_exc()})


def test_cpu2_engine_matches_and_killed_worker_fails_fast(tiny_random_dir):
    res = spawn_scenario(_scenario, (str(tiny_random_dir),), 300)
    assert res["two"] == res["one"] and len(res["one"]) == 8  # cpu:2 (TP_TP) greedy = one process
    sig = int(signal.SIGKILL)
    assert res["err"] == (f"worker rank 1 (pid {res['pid']}) has exited (killed by signal {sig}); "
                          "the engine cannot continue without it: restart the engine")
    assert res["elapsed"] < 30
