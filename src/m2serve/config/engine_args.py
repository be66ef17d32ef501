"""Deployment / engine arguments shared by the CLI, the recipes, the planner and the engine.

Defaults follow MAX (docs/serving.md §7–§9). Field names match the CLI flags
(``--max-batch-input-tokens`` -> ``max_batch_input_tokens``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Compute ("activation") dtypes by name -> bytes per element. The names are torch's
#: (``getattr(torch, name)``); the CLI choices, the planner and the engine all read this table.
COMPUTE_DTYPES = {"bfloat16": 2, "float32": 4}
#: The compute dtype when none is given (MiniMax-M2's own; vLLM's ``--dtype auto``).
DEFAULT_DTYPE = "bfloat16"
#: KV-cache element formats by name -> bytes per element (fp8 KV: docs/checkpoints.md §3.6).
KV_CACHE_FORMATS = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def dtype_bytes(field: str, name: str) -> int:
    """Bytes per element of ``name`` for ``field`` "dtype" (COMPUTE_DTYPES) or "kv_cache_format"
    (KV_CACHE_FORMATS). Raises ValueError naming the field, the value and the choices."""
    table = COMPUTE_DTYPES if field == "dtype" else KV_CACHE_FORMATS
    if name not in table:
        raise ValueError(f"{field}={name!r} is not supported; use one of {sorted(table)}")
    return table[name]


#: Every accepted ``EngineArgs.weight_dequant`` value (the planner refuses others; tests iterate it).
WEIGHT_DEQUANT_MODES = ("auto", "load", "runtime")
#: Every accepted ``EngineArgs.fp8_linear`` value: the Triton FP8 linear's activation mode
#: (docs/kernels.md §4), bf16 activations (default) or per-token-group dynamic e4m3.
FP8_LINEAR_MODES = ("w8a16", "w8a8")
#: Every accepted ``EngineArgs.activation_quant`` value (docs/checkpoints.md §9).
ACTIVATION_QUANT_MODES = ("auto", "none")
#: Every accepted ``EngineArgs.quantize_unquantized`` value: ``"none"`` (default, the checkpoint's
#: bf16 linears stay bf16) or ``"fp8"`` (FP8-block at load, docs/checkpoints.md §6 "Online FP8").
QUANTIZE_UNQUANTIZED_MODES = ("none", "fp8")

#: Every accepted ``EngineArgs.attention_backend`` value (``--attention-backend``, vLLM's and
#: SGLang's flag name; docs/kernels.md §7): "torch" the reference and the CPU default, "triton" the
#: paged attention kernel (kernels/triton/attention.py), "auto" triton on a GPU where Triton imports.
ATTENTION_BACKENDS = ("auto", "torch", "triton")

#: Every accepted ``speculative_config.method``: n-gram prompt lookup (docs/serving.md §13) and an
#: EAGLE-3 draft model (docs/serving.md §14).
SPECULATIVE_METHODS = ("ngram", "eagle3")
#: Largest ``speculative_config.num_speculative_tokens`` accepted (drafted tokens per step and request).
MAX_SPECULATIVE_TOKENS = 32
#: ``prompt_lookup_min`` / ``prompt_lookup_max`` when the config leaves both unset (docs/serving.md §13).
DEFAULT_PROMPT_LOOKUP = (2, 4)
#: Largest ``prompt_lookup_max`` accepted (tokens; m2serve's bound, vLLM documents none): the
#: proposer's index holds max - min + 1 entries per token (docs/serving.md §13).
MAX_PROMPT_LOOKUP = 32


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` with exactly one slash and no leading ``.``/``/``/``~`` (not a path): the shape of a
    Hugging Face hub id, for ``--model`` and an EAGLE-3 draft's ``speculative_config.model``."""
    return (
        model.count("/") == 1
        and not model.startswith((".", "/", "~"))
        and all(part.strip() for part in model.split("/"))
    )


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (docs/serving.md §13), vLLM's ``speculative_config`` shape.

    method: one of SPECULATIVE_METHODS; num_speculative_tokens: K, tokens drafted per request and step
    (1..MAX_SPECULATIVE_TOKENS); prompt_lookup_min / prompt_lookup_max: the n-gram lengths (tokens)
    the proposer matches, 1 <= min <= max <= MAX_PROMPT_LOOKUP (ngram; None for eagle3); model: the
    EAGLE-3 draft's local directory or hub id (eagle3; None for ngram; a hub id is resolved to its
    local snapshot by the serve layer, serve/resolve.py ``resolve_engine_args``). Build it with
    :func:`parse_speculative_config`.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None
    prompt_lookup_max: int | None
    model: str | None = None

    def describe(self) -> str:
        """The banner's words: ``ngram k=4 lookup 2..4`` or ``eagle3 k=3 draft DIR``."""
        if self.method == "eagle3":
            return f"eagle3 k={self.num_speculative_tokens} draft {self.model}"
        return (f"{self.method} k={self.num_speculative_tokens} "
                f"lookup {self.prompt_lookup_min}..{self.prompt_lookup_max}")


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """``EngineArgs.speculative_config`` (``--speculative-config JSON``, the recipe's
    ``runtime.speculative_config``, ``LLM(speculative_config=...)``) as a `SpeculativeConfig`; None
    (off) for None or an empty string. Accepts a JSON object string, a mapping or a `SpeculativeConfig`
(whose fields are checked the same way).

    Keys: method (required, one of SPECULATIVE_METHODS), num_speculative_tokens (required, an
    integer in [1, MAX_SPECULATIVE_TOKENS]); for ngram prompt_lookup_min / prompt_lookup_max
    (integers in [1, MAX_PROMPT_LOOKUP], min <= max; one unset takes the other's value, both unset
    DEFAULT_PROMPT_LOOKUP); for eagle3 model (required: a local directory holding config.json, or a
    hub id ``org/name`` that names no local path; docs/serving.md §14). Raises ValueError naming the
    field (``speculative_config.<key>``) for a bad value, an unknown key or a key of the other method.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, SpeculativeConfig):   # built directly: checked like any other value
        value = {f: getattr(value, f) for f in value.__slots__ if getattr(value, f) is not None}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno}); "
                             'give an object such as {"method": "ngram", "num_speculative_tokens": 4}') from e
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
    known = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]}: unknown key; accepted keys: {', '.join(known)}")

    def integer(name: str, low: int, high: int | None) -> int | None:
        v = value.get(name)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"speculative_config.{name}={v!r}: must be an integer {bound}")
        return v

    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method={method!r}: must be one of {list(SPECULATIVE_METHODS)}")
    k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("speculative_config.num_speculative_tokens: required (tokens drafted per step, "
                         f"1..{MAX_SPECULATIVE_TOKENS})")
    if method == "eagle3":
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if value.get(key) is not None:
                raise ValueError(f"speculative_config.{key}: an ngram key; method eagle3 takes model instead")
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model: required for method eagle3 "
                             "(the draft's local directory or hub id)")
        local = Path(model).expanduser()
        if (local / "config.json").is_file():
            model = str(local)   # ~ expanded
        elif local.exists() or not looks_like_hub_id(model):
            raise ValueError(f"speculative_config.model={model!r}: not a directory with a config.json "
                             "(nor a hub id of the form org/name)")
        return SpeculativeConfig(method, k, None, None, model)
    if value.get("model") is not None:
        raise ValueError("speculative_config.model: only method eagle3 takes a draft model")
    lo = integer("prompt_lookup_min", 1, MAX_PROMPT_LOOKUP)
    hi = integer("prompt_lookup_max", 1, MAX_PROMPT_LOOKUP)
    if lo is None and hi is None:
        lo, hi = DEFAULT_PROMPT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:  # type: ignore[operator]
        raise ValueError(f"speculative_config.prompt_lookup_min={lo}: must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig(method, k, lo, hi)  # type: ignore[arg-type]


@dataclass(slots=True)
class EngineArgs:
    """Everything needed to build an engine besides the checkpoint itself.

    model: local directory or hub id (None = the embedded default checkpoint).
    dtype: compute ("activation") dtype name: "bfloat16" (default) or "float32".
    devices: "cpu", "cpu:N" (N CPU ranks), "gpu", "gpu:0,1,...".
    kv_cache_format: "bfloat16" | "float32" | "float8_e4m3fn".
    num_kv_pages: override the planner's page count (tests use tiny pools to force preemption). Like
        the planner's count, max_batch_input_tokens and max_batch_size, it is per data-parallel
        replica (docs/serving.md §8).
    weight_dequant: "auto" (default: "runtime" on a GPU, and on a CPU where the packed-weight kernels
        run the activations — bf16/fp32, kernels built — else "load"), "load" (dequantise at load) or
        "runtime" (keep quantised weights as stored — FP8 linears, FP4 experts — and compute from them
        when used; model/load.py ``resolve_weight_dequant``).
    fp8_linear: GPU FP8-block linears on the Triton kernel: "w8a16" (default: bf16 activations,
        the dequantised weights' values) or "w8a8" (activations quantised per token and 128-column
        group to e4m3, FP8 tensor cores, sm_89+); docs/kernels.md §4.
    activation_quant: "auto" (default: quantise every quantised linear's input as the checkpoint
        declares — Quark ``input_tensors`` MXFP4, NVFP4 input scales — W4A4, docs/checkpoints.md §9)
        or "none" (weight-only, W4A16; model/load.py ``resolve_activation_quant``).
    quantize_unquantized: "none" (default) or "fp8": quantise, at load, the linears the checkpoint
        leaves dense (attention and lm_head of the FP4 releases; every linear but the experts of a
        bf16 one) to FP8 block 128x128 e4m3 with ``weight_scale_inv`` = amax / 448 per block
        (model/load.py ``quantize_dense_linears``; docs/checkpoints.md §6 "Online FP8").
    kv_cache_memory_gib: CPU only: GiB of KV pages per rank (None = min(4 GiB, what min(max_batch_size,
        8) sequences of max_length tokens need); engine/planner.py). GPU pools follow
        device_memory_utilization.
    strict_tool_format: refuse to start when the chat template writes tool calls the tool parser
        cannot read (text/tool_format.py); without it that is a warning.
    threads: intra-op CPU threads per process (None = :func:`choose_num_threads`'s rule).
    attention_backend: one of ATTENTION_BACKENDS, chosen once when the model is built
        (model/attention.py ``resolve_attention_backend``).
    enforce_eager: never capture CUDA graphs (vLLM's ``--enforce-eager``): every decode step runs
        eagerly. Without it, on one CUDA device or TP_TP CUDA ranks with the triton attention
        backend, decode steps replay one CUDA graph per batch-size bucket (docs/serving.md §6.3);
        CPU, EP modes, DP replicas and the torch backend run eager anyway (the banner says why).
    batch_invariant: the batch-invariant mode (docs/model.md §7): a request's logits, hence a seeded
        request's tokens, do not depend on what else is in the batch, at some speed cost. Also
        ``M2SERVE_BATCH_INVARIANT=1`` (:func:`batch_invariant_enabled`); chosen once at load.
    speculative_config: speculative decoding (docs/serving.md §13): None (default, off), a JSON
        object string, a mapping or a `SpeculativeConfig` (:func:`parse_speculative_config`).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = DEFAULT_DTYPE
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
    weight_dequant: str = "auto"
    fp8_linear: str = "w8a16"
    activation_quant: str = "auto"
    quantize_unquantized: str = "none"
    kv_cache_memory_gib: float | None = None
    strict_tool_format: bool = False
    seed: int = 0
    threads: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False
    speculative_config: Any = None


class EngineArgError(ValueError):
    """A bad ``EngineArgs`` value, with the field it belongs to (``field``, an EngineArgs field name
    such as ``"max_batch_size"``) so that the CLI can name its flag (``--max-batch-size``); the
    message itself is ``str(error)`` (engine/planner.py ``check_engine_args``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


#: Environment variable that turns the batch-invariant mode on for every entry point.
BATCH_INVARIANT_ENV = "M2SERVE_BATCH_INVARIANT"


def batch_invariant_enabled(args: EngineArgs, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the model is loaded in the batch-invariant mode: ``args.batch_invariant``
    (``--batch-invariant``, ``LLM(..., batch_invariant=True)``) or ``M2SERVE_BATCH_INVARIANT`` set to
    1/true/yes/on (0/false/no/off or empty: off). Raises ValueError naming the variable for another
    value."""
    env = os.environ if environ is None else environ
    raw = env.get(BATCH_INVARIANT_ENV, "").strip().lower()
    if raw not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ValueError(f"{BATCH_INVARIANT_ENV}={raw!r}: use 1 or 0 (true/false)")
    return bool(args.batch_invariant) or raw in ("1", "true", "yes", "on")


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


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The intra-op thread count of this process and the rule that chose it (for the banner).
    ``threads`` is None on GPU deployments (torch's default is kept)."""

    threads: int | None
    rule: str


def choose_num_threads(args: EngineArgs, environ: Mapping[str, str] | None = None) -> ThreadChoice:
    """The one rule for torch's intra-op thread count, used by every entry point (``m2serve serve``,
    ``m2serve generate``, the Python ``LLM``) and by every CPU rank (docs/serving.md §12):

    1. ``args.threads`` when set (``--threads N``, ``M2SERVE_THREADS``; ValueError unless N >= 1);
    2. else ``OMP_NUM_THREADS`` when the environment sets it (a deliberate choice, respected);
    3. GPU devices: None, torch's default is kept (the host threads only feed the device);
    4. several CPU processes on this machine — ``cpu:N`` ranks, or torchrun's LOCAL_WORLD_SIZE > 1 —
       one thread per rank (the ranks already share the cores; more threads only contend);
    5. one CPU process: one thread per physical core available to it (:func:`physical_cores`;
       hyper-threads share a core's vector units, and a default of all logical CPUs is what made
       a loaded machine 5-20x slower).
    """
    env = os.environ if environ is None else environ
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"threads={args.threads} must be >= 1 (or unset: physical cores, one per "
                             f"rank with cpu:N)")
        return ThreadChoice(args.threads, "--threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    if not args.devices.startswith("cpu"):
        return ThreadChoice(None, "GPU: torch default")
    ranks = len(rank_devices(args.devices))
    local = int(env.get("LOCAL_WORLD_SIZE", "1")) if "RANK" in env else 1
    if max(ranks, local) > 1:
        return ThreadChoice(1, f"one per rank, {max(ranks, local)} CPU ranks")
    return ThreadChoice(physical_cores(), "physical cores")


def physical_cores() -> int:
    """Physical cores this process may run on: the distinct (package, core) pairs of the CPUs in
    its affinity mask (Linux sysfs topology; a CPU without topology counts as its own core),
    capped by a cgroup v2 CPU quota (``cpu.max``) when one is set. At least 1."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    n = len(cores)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def apply_num_threads(args: EngineArgs) -> ThreadChoice:
    """Set torch's intra-op thread count by :func:`choose_num_threads`, log it (the Python API's
    banner line, INFO) and return the choice."""
    import torch

    choice = choose_num_threads(args)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    log.info("torch intra-op threads: %d (%s)", torch.get_num_threads(), choice.rule)
    return choice
