"""Deployment / engine arguments shared by the CLI, the recipes, the planner and the engine.

Defaults follow MAX (docs/serving.md §7–§9). Field names match the CLI flags
(``--max-batch-input-tokens`` -> ``max_batch_input_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Compute ("activation") dtypes by name -> bytes per element. The names are torch's
#: (``getattr(torch, name)``); the CLI choices, the planner and the engine all read this table.
COMPUTE_DTYPES = {"bfloat16": 2, "float32": 4}
#: KV-cache element formats by name -> bytes per element (fp8 KV: docs/checkpoints.md §3.6).
KV_CACHE_FORMATS = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def dtype_bytes(field: str, name: str) -> int:
    """Bytes per element of ``name`` for ``field`` "dtype" (COMPUTE_DTYPES) or "kv_cache_format"
    (KV_CACHE_FORMATS). Raises ValueError naming the field, the value and the choices."""
    table = COMPUTE_DTYPES if field == "dtype" else KV_CACHE_FORMATS
    if name not in table:
        raise ValueError(f"{field}={name!r} is not supported; use one of {sorted(table)}")
    return table[name]


@dataclass(slots=True)
class EngineArgs:
    """Everything needed to build an engine besides the checkpoint itself.

    model: local directory or hub id (None = the embedded default checkpoint).
    dtype: compute ("activation") dtype name: "bfloat16" (default) or "float32".
    devices: "cpu", "cpu:N" (N CPU ranks), "gpu", "gpu:0,1,...".
    kv_cache_format: "bfloat16" | "float32" | "float8_e4m3fn".
    num_kv_pages: override the planner's page count (tests use tiny pools to force preemption).
    weight_dequant: "load" (dequantise at load) or "runtime" (keep quantised weights as stored — FP8
        linears, FP4 experts — and dequantise them when used; model/load.py).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "bfloat16"
    devices: str = "cpu"
    data_parallel_degree: int = 1
    ep_size: int = 1
    ep_use_allreduce: bool = False
    max_batch_input_tokens: int = 8192
    max_batch_size: int = 256
    max_length: int | None = None
    device_memory_utilization: float = 0.9
    kv_cache_page_size: int = 128
    kv_cache_format: str = "bfloat16"
    enable_prefix_caching: bool = True
    num_kv_pages: int | None = None
    weight_dequant: str = "load"
    seed: int = 0


def rank_devices(devices: str) -> list[str]:
    """torch device of every rank for an ``EngineArgs.devices`` string: "cpu" / "gpu" -> one rank,
    "cpu:N" -> N x "cpu", "gpu:0,2" -> ["cuda:0", "cuda:2"]. Its length is the local world size.

    Raises ValueError naming the accepted forms.
    """
    kind, _, rest = devices.partition(":")
    if kind == "cpu" and (not rest or (rest.isdigit() and int(rest) > 0)):
        return ["cpu"] * (int(rest) if rest else 1)
    if kind == "gpu" and (not rest or all(d.strip().isdigit() for d in rest.split(","))):
        return [f"cuda:{d.strip()}" for d in rest.split(",")] if rest else ["cuda:0"]
    raise ValueError(f"devices={devices!r}: use cpu, cpu:N (N CPU ranks), gpu or gpu:0,1,...")
