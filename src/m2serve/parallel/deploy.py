"""Start a multi-rank model for the engine: spawned ranks (``--devices cpu:N`` / ``gpu:0,1,…``)
or torchrun ranks (env:// rendezvous, multi-node). docs/parallelism.md §1, §5.

Rank 0 (the engine process) gets a :class:`~m2serve.parallel.worker.DistributedModel`, which has
the single-process model's call contract; every other rank loads its shard and serves steps
until rank 0 stops it.

Multi-node (world size = devices per node × nodes; here 2 nodes × 2 CPU ranks on one machine)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29511 my_script.py      # and --node-rank 1 on the second node

where ``my_script.py`` calls :func:`join_torchrun` and, on rank 0 only (it returns None on the
others once they are stopped), builds ``LLMEngine.from_model(model, model.config, args)``.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist

from m2serve.config.engine_args import (
    EngineArgs,
    apply_num_threads,
    batch_invariant_enabled,
    choose_num_threads,
    dtype_bytes,
    rank_devices,
)
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import Deployment, ParallelState, validate_deployment
from m2serve.formats.detect import detect_encoding
from m2serve.parallel.launch import DEFAULT_TIMEOUT_S, init_from_env, spawn_workers
from m2serve.parallel.worker import DistributedModel, load_rank_model, worker_loop


def plan_deployment(args: EngineArgs, world_size: int,
                    num_nodes: int = 1) -> tuple[MiniMaxM2Config, Deployment]:
    """Config + validated deployment (rules V1–V10) for ``args`` on ``world_size`` ranks."""
    if args.model is None:
        raise ValueError("EngineArgs.model is None: pass a checkpoint directory")
    config = MiniMaxM2Config.from_pretrained(args.model)
    encoding = detect_encoding(config.quantization_config, config.source).value
    dep = validate_deployment(
        config, world_size, args.data_parallel_degree, args.ep_size, encoding=encoding,
        ep_use_allreduce=args.ep_use_allreduce, device_memory_utilization=args.device_memory_utilization,
        max_batch_size=args.max_batch_size, max_batch_input_tokens=args.max_batch_input_tokens,
        num_nodes=num_nodes)
    return config, dep


def _dtype(args: EngineArgs) -> torch.dtype:
    dtype_bytes("dtype", args.dtype)
    return getattr(torch, args.dtype)


def load_rank(args: EngineArgs, state: ParallelState, device: torch.device | str) -> Any:
    """This rank's shard of ``args.model`` with ``args.dtype``, ``args.weight_dequant``,
    ``args.fp8_linear``, the batch-invariant mode, ``args.activation_quant`` and
    ``args.quantize_unquantized`` and ``args.attention_backend``: the one load every multi-rank
    path (spawned ranks, rank 0, torchrun ranks) goes through."""
    return load_rank_model(args.model, state, _dtype(args), device, args.weight_dequant, args.fp8_linear,
                           batch_invariant_enabled(args), args.activation_quant, args.quantize_unquantized,
                           args.attention_backend)


def _serve_rank(rank: int, world_size: int, args: EngineArgs, dep: Deployment, devices: list[str],
                threads: int | None) -> None:
    """A spawned rank: set rank 0's thread choice, load its shard, serve steps until rank 0 says stop."""
    if threads is not None:
        torch.set_num_threads(threads)
    state = dep.state(rank)
    model = load_rank(args, state, devices[rank])
    worker_loop(model, state, devices[rank])


def start_distributed_model(args: EngineArgs, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistributedModel:
    """Validate the deployment, spawn ranks 1…P−1 of ``args.devices``, load rank 0's shard here.

    Returns rank 0's DistributedModel (stopped at interpreter exit, or by ``shutdown()``).
    Collectives time out after ``timeout_s``. Raises ValueError for a refused deployment (before
    any process starts), WorkerError if a worker dies while the group forms.
    """
    devices = rank_devices(args.devices)
    config, dep = plan_deployment(args, len(devices))
    _dtype(args)  # refuse a bad dtype before any process starts
    threads = choose_num_threads(args).threads
    workers = spawn_workers(len(devices), _serve_rank, (args, dep, devices, threads),
                            devices=devices, timeout_s=timeout_s)
    state = dep.state(0)
    model = DistributedModel(load_rank(args, state, devices[0]), state, workers)
    atexit.register(model.shutdown)
    return model


def join_torchrun(args: EngineArgs, timeout_s: float = DEFAULT_TIMEOUT_S,
                  num_nodes: int | None = None) -> DistributedModel | None:
    """Join a torchrun / env:// deployment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    CPU ranks when ``args.devices`` starts with "cpu", else CUDA ``cuda:LOCAL_RANK``. Rank 0
    returns its DistributedModel; every other rank serves steps and returns None once rank 0
    stops it (then leaves the process group). ``num_nodes`` only shapes validation messages
    (default: the NNODES / GROUP_WORLD_SIZE torchrun sets, else 1).
    """
    kind = "cpu" if args.devices.startswith("cpu") else "cuda"
    rank, world, device = init_from_env(kind, timeout_s)
    apply_num_threads(args)  # --threads overrides the one-per-rank default on every rank
    nodes = num_nodes or int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")))
    _, dep = plan_deployment(args, world, nodes)
    state = dep.state(rank)
    model = load_rank(args, state, device)
    if rank == 0:
        dm = DistributedModel(model, state)
        atexit.register(dm.shutdown)
        return dm
    try:
        worker_loop(model, state, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return None
