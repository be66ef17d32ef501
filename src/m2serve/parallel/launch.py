"""Process launch and process groups: one process per device (docs/parallelism.md §1–§3).

CPU ranks use gloo with one intra-op thread per rank (config/engine_args.py
``choose_num_threads``: P ranks share the cores instead of oversubscribing them); CUDA ranks use
NCCL with one GPU per rank (``cuda:{local rank}``). Every
collective has a timeout, so a dead peer turns into an error instead of a hang.

Two ways to get ranks:
- :func:`spawn_workers` / :class:`WorkerGroup`: the calling process is rank 0 (it hosts the
  scheduler) and ranks 1…P−1 are ``torch.multiprocessing`` spawn children on this machine;
- torchrun / env:// rendezvous (multi-node): every process calls :func:`init_process_group` with
  ``init_method="env://"`` and reads RANK / WORLD_SIZE / LOCAL_RANK from the environment.
:func:`run_ranks` runs a function on P fresh spawned ranks and returns their results (tests,
benchmarks).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m2serve.config.engine_args import EngineArgs, choose_num_threads

DEFAULT_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    """A rank died or failed; the message names the rank, its pid / exit code and the cause."""


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, *, device: str = "cpu", init_method: str = "env://",
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the default process group; returns this rank's torch device.

    device "cpu": gloo, one intra-op thread per rank when world_size > 1 (choose_num_threads).
    device "cuda:N": NCCL on GPU N; plain "cuda": GPU
    ``LOCAL_RANK`` (torchrun sets it; else ``rank``). ``init_method`` is
    "env://" (MASTER_ADDR / MASTER_PORT) or "tcp://host:port". Every collective of the group fails
    after ``timeout_s`` seconds instead of waiting for a dead peer.
    """
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = torch.device(device) if ":" in device else torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(choose_num_threads(EngineArgs(devices=f"cpu:{world_size}")).threads or 1)
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dev


def init_from_env(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """torchrun / env:// rendezvous: join with RANK and WORLD_SIZE from the environment.

    Returns (rank, world_size, device). Raises ValueError naming the missing variable when the
    process was not started by torchrun (or with the variables set by hand).
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"env:// rendezvous needs {', '.join(missing)} in the environment; start the "
                         f"ranks with torchrun (e.g. torchrun --nnodes 2 --nproc-per-node 2 ...)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, init_process_group(rank, world, device=device, init_method="env://",
                                           timeout_s=timeout_s)


def _rank_main(rank: int, world_size: int, init_method: str, device: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    """Entry point of one spawned rank: join the group, run ``fn(rank, world_size, *args)``,
    report (rank, ok, value-or-traceback) on ``results``."""
    try:
        init_process_group(rank, world_size, device=device, init_method=init_method, timeout_s=timeout_s)
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # reported to the parent, which raises WorkerError
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe_exit(p: Any) -> str:
    code = p.exitcode
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
              timeout_s: float = DEFAULT_TIMEOUT_S, wall_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh spawned ranks; returns the
    results in rank order.

    ``fn`` must be importable (module level). Collectives time out after ``timeout_s``; the whole
    run after ``wall_s``. Raises WorkerError with the failing rank's traceback (or how it died:
    signal / exit code) as soon as one rank fails; the other ranks are terminated.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, init, device, timeout_s, fn, args, results),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + wall_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None:
                        try:  # its report may have landed just before it exited
                            rank, ok, value = results.get(timeout=1.0)
                            break
                        except queue.Empty:
                            raise WorkerError(f"rank {r} (pid {p.pid}) died without a result "
                                              f"({_describe_exit(p)})") from None
                else:
                    if time.monotonic() > deadline:
                        raise WorkerError(f"ranks {sorted(set(range(world_size)) - set(out))} did not "
                                          f"finish within {wall_s:.0f} s") from None
                    continue
            if not ok:
                time.sleep(0.5)  # a peer that died is the cause; name it first
                dead = [f"rank {r} (pid {p.pid}) died without a result ({_describe_exit(p)})"
                        for r, p in enumerate(procs) if r not in out and r != rank and p.exitcode is not None
                        and p.exitcode != 0]
                raise WorkerError("; ".join([*dead, f"rank {rank} failed:\n{value}"]))
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(out) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]


@dataclass(slots=True)
class WorkerGroup:
    """Ranks 1…P−1 spawned by rank 0 (the calling process), which joins the group itself.

    ``check()`` raises WorkerError if a worker has died; ``shutdown()`` waits for the workers to
    exit (they stop when rank 0 tells them, see parallel/worker.py) and kills stragglers.
    """

    world_size: int
    procs: list[Any] = field(default_factory=list)
    closed: bool = False

    def check(self, wait_s: float = 0.0) -> None:
        """Raise WorkerError naming the first dead worker (rank, pid, signal or exit code).
        ``wait_s``: give a dying worker that long to be reaped first (after a failed collective)."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise WorkerError(f"worker rank {r} (pid {p.pid}) has exited ({_describe_exit(p)}); the "
                                  f"engine cannot continue without it: restart the engine")

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Join the workers (after they were told to stop), killing any still alive after ``grace_s``."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def spawn_workers(world_size: int, target: Callable[..., Any], args: tuple[Any, ...], *,
                  devices: Sequence[str] = ("cpu",), timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """Spawn ranks 1…P−1 running ``target(rank, world_size, *args)`` inside the process group and
    join it as rank 0 from the calling process. Returns the :class:`WorkerGroup`.

    ``devices[r]`` is rank r's device ("cpu" or "cuda:N"; a single entry serves every rank).

    Raises WorkerError if a worker dies before the group forms (instead of waiting for the
    rendezvous timeout).
    """
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    group = WorkerGroup(world_size)
    for r in range(1, world_size):
        dev = devices[r] if len(devices) > 1 else devices[0]
        p = ctx.Process(target=_worker_main, args=(r, world_size, init, dev, timeout_s, target, args),
                        daemon=True)
        p.start()
        group.procs.append(p)
    try:
        init_process_group(0, world_size, device=devices[0], init_method=init, timeout_s=timeout_s)
    except BaseException:
        group.shutdown(grace_s=0.0)
        group.check()
        raise
    return group


def _worker_main(rank: int, world_size: int, init_method: str, device: str, timeout_s: float,
                 target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        init_process_group(rank, world_size, device=device, init_method=init_method, timeout_s=timeout_s)
        target(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
