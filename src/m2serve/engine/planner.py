"""Memory planner: from config.json alone plus the deployment, how many KV pages fit (docs/serving.md §7).

Per device d (every device of a balanced deployment holds the same bytes; the free memory is the
smallest over the devices):

    static_d    = weights_d + activations_d + scratch_d
    kv_budget_d = floor(free_d * device_memory_utilization - static_d)       GPU
    kv_budget_d = kv_cache_memory_gib, default min(4 GiB,                    CPU (vLLM's CPU KV-cache
                  min(max_batch_size, 8) x ceil(max_length / page_size)      space is 4 GiB)
                  pages)
    pages       = kv_budget_d // (page_size * kv_bytes_per_token_d)

On CPU the pool is a fixed size, not "what RAM is free right now": RAM is shared with the rest of
the machine, and a pool sized by MemAvailable changed from run to run and took most of the RAM.

Nothing here reads weights. The mode and degrees come from config/parallel.py
(``validate_deployment`` -> ``select_parallelism_mode``, rules V1–V10), the per-rank tensor bytes
from parallel/shard.py (the same shard plans the loader applies), the encoding from
formats/detect.py.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from m2serve.config.eagle3 import Eagle3DraftConfig
from m2serve.config.engine_args import (
    ACTIVATION_QUANT_MODES,
    ATTENTION_BACKENDS,
    FP8_LINEAR_MODES,
    QUANTIZE_UNQUANTIZED_MODES,
    WEIGHT_DEQUANT_MODES,
    EngineArgError,
    EngineArgs,
    batch_invariant_enabled,
    choose_num_threads,
    dtype_bytes,
    parse_speculative_config,
    rank_devices,
)
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import Deployment, ParallelismMode, shard_ranges, validate_deployment
from m2serve.config.quant import MXFP4_GROUP, NVFP4_GROUP
from m2serve.formats.detect import Encoding, detect_encoding
from m2serve.model.load import numerics_banner, resolve_weight_dequant
from m2serve.parallel.shard import rank_weight_bytes

log = logging.getLogger(__name__)

GiB = 1024 ** 3
MiB = 1024 ** 2
#: Reserve per device for collective buffers when more than one device runs (docs/serving.md §7).
MULTI_DEVICE_RESERVE = 256 * MiB
#: Default ceiling of the CPU KV pool per rank (vLLM's CPU KV-cache space default is 4 GiB too).
CPU_KV_DEFAULT_BYTES = 4 * GiB
#: Full-context sequences the default CPU KV pool holds (a modest concurrency: shorter requests share
#: the pages, so more of them run at once). Sizing it for max_batch_size (256) sequences made the
#: 16 MB tiny-chat hold a 4 GiB pool (its 4,096-token context x 256), 4.4 GB of RSS.
CPU_KV_DEFAULT_SEQUENCES = 8
_GPU_KV_SOURCE = "free x device_memory_utilization - static"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The plan for one device of the deployment; every ``*_bytes`` figure is per device.

    weight_dequant: the mode the ranks load with, ``"load"`` or ``"runtime"`` (``"auto"`` resolved for
      the device kind and dtype by model/load.py ``resolve_weight_dequant``, as the loader does).
    weight_bytes: resident weights (what :func:`plan_memory` fits): quantised linears dequantised
      to the compute dtype with ``weight_dequant="load"``, held as stored with ``"runtime"``.
    checkpoint_bytes: the same tensors with quantised linears as stored in the checkpoint
      (docs/serving.md §7 table; router gate + bias counted in fp32, as held).
    activation_bytes: with EP the EP buffer estimate (MAX formulas, :func:`ep_activation_bytes`) /
      devices; without EP one step's dense activations (:func:`dense_activation_bytes`).
      scratch_bytes: 256 MiB when more than one device runs.
    free_bytes / memory_source: the device memory the plan starts from and where it came from.
    kv_bytes_per_token: K and V of all layers for the KV heads this device holds.
    numerics: which numerics the quantised linears run (model/load.py ``numerics_banner``: W4A4 as
      the checkpoint declares, or unquantised activations).
    kv_source: how kv_budget_bytes was chosen (CPU: --kv-cache-memory-gib or its default rule).
    num_pages x page_size = kv_tokens: the pool of one data-parallel replica (each replica's engine
      scheduler has its own, docs/serving.md §8), so the longest context one replica can hold; the
      deployment holds data_parallel_degree x num_pages pages.
    max_length: the context limit requests get (max_position_embeddings or EngineArgs.max_length,
      lowered to kv_tokens with a warning when the default does not fit).
    """

    mode: ParallelismMode
    num_devices: int
    tp_size: int
    ep_size: int
    data_parallel_degree: int
    encoding: str
    dtype: str
    weight_dequant: str
    weight_bytes: int
    checkpoint_bytes: int
    activation_bytes: int
    scratch_bytes: int
    free_bytes: int
    memory_source: str
    device_memory_utilization: float
    kv_cache_format: str
    kv_budget_bytes: int
    kv_bytes_per_token: int
    page_size: int
    num_pages: int
    max_length: int
    kv_source: str = _GPU_KV_SOURCE
    numerics: str = ""

    @property
    def static_bytes(self) -> int:
        """weights + activations + scratch."""
        return self.weight_bytes + self.activation_bytes + self.scratch_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool holds (pages x page size) per replica."""
        return self.num_pages * self.page_size


def check_page_and_length(args: EngineArgs) -> int:
    """Validate ``kv_cache_page_size`` (> 0) and ``max_length`` (unset or > 0); return the page size.
    Raises ValueError naming the field and value."""
    S = args.kv_cache_page_size
    if S <= 0:
        raise ValueError(f"kv_cache_page_size={S} must be positive")
    if args.max_length is not None and args.max_length <= 0:
        raise ValueError(f"max_length={args.max_length} must be a positive integer (or unset: the "
                         "config's max_position_embeddings, capped to the KV cache)")
    return S


def check_engine_args(config: MiniMaxM2Config, args: EngineArgs,
                      world_size: int | None = None) -> Deployment:
    """Every check of ``args`` that needs no weights and no memory measurement, in one call, so that
    an entry point refuses a bad value before it binds a port or reads a weight (docs/serving.md §12):
    the choice fields (dtype, kv_cache_format, weight_dequant, fp8_linear, activation_quant,
    quantize_unquantized, attention_backend), devices' form, the deployment rules V1–V10 on
    ``world_size`` ranks (default: ``args.devices``' count; torchrun passes its WORLD_SIZE;
    docs/parallelism.md §5), kv_cache_page_size and max_length (and max_length against an explicit
    num_kv_pages pool), num_kv_pages >= 1, kv_cache_memory_gib > 0, threads >= 1, speculative_config
    and batch_invariant (CPU only, ``M2SERVE_BATCH_INVARIANT``).

    Returns the validated :class:`Deployment`. Raises :class:`EngineArgError` (a ValueError) whose
    ``field`` is the EngineArgs field at fault (``devices`` for a world size the model's heads or
    experts cannot be split over) and whose message is the consumer's own (it names field and value).
    """
    def field(name: str, check, *a):
        try:
            return check(*a)
        except EngineArgError:
            raise
        except ValueError as e:
            raise EngineArgError(name, str(e)) from e

    def choice(name: str, accepted: tuple[str, ...]) -> None:
        value = getattr(args, name)
        if value not in accepted:
            raise EngineArgError(name, f"{name}={value!r} is not supported; use one of {list(accepted)}")

    field("dtype", dtype_bytes, "dtype", args.dtype)
    field("kv_cache_format", dtype_bytes, "kv_cache_format", args.kv_cache_format)
    for name, accepted in (("weight_dequant", WEIGHT_DEQUANT_MODES), ("fp8_linear", FP8_LINEAR_MODES),
                           ("activation_quant", ACTIVATION_QUANT_MODES),
                           ("quantize_unquantized", QUANTIZE_UNQUANTIZED_MODES),
                           ("attention_backend", ATTENTION_BACKENDS)):
        choice(name, accepted)
    field("devices", rank_devices, args.devices)
    try:
        dep = _deployment(config, args, world_size)
    except ValueError as e:  # V1–V10: the field the message starts with, else the device count's
        head = str(e).split("=", 1)[0]
        raise EngineArgError(head if head in EngineArgs.__dataclass_fields__ else "devices", str(e)) from e
    if args.kv_cache_page_size <= 0:
        field("kv_cache_page_size", check_page_and_length, args)
    field("max_length", check_page_and_length, args)
    if args.num_kv_pages is not None:
        if args.num_kv_pages < 1:
            raise EngineArgError("num_kv_pages", f"num_kv_pages={args.num_kv_pages} must be a positive "
                                 "integer (or unset: the memory planner's count)")
        if args.max_length is not None:
            field("max_length", fit_max_length, args.max_length, config.max_position_embeddings,
                  args.num_kv_pages, args.kv_cache_page_size)
    field("kv_cache_memory_gib", cpu_kv_pool_bytes, config, args, dep.max_batch_size,
          args.kv_cache_page_size)
    if args.threads is not None:
        field("threads", choose_num_threads, args)
    field("speculative_config", parse_speculative_config, args.speculative_config)
    if field("batch_invariant", batch_invariant_enabled, args) and not args.devices.startswith("cpu"):
        raise EngineArgError("batch_invariant", f"batch_invariant: implemented for CPU devices only, not "
                             f"devices={args.devices!r} (docs/model.md §7)")
    return dep


def fit_max_length(requested: int | None, default: int, num_pages: int, page_size: int) -> int:
    """The longest context one sequence may have, in tokens (docs/serving.md §7).

    ``requested`` (the user's max_length, or None) defaults to ``default`` (max_position_embeddings).
    If one such sequence does not fit in ``num_pages`` pages of ``page_size`` tokens, an unset value
    is lowered with a warning; an explicit one raises ValueError stating the largest length that fits.
    """
    capacity = num_pages * page_size
    max_length = requested or default
    if max_length > capacity:
        if requested is not None:
            raise ValueError(f"max_length={requested} does not fit in the KV cache: {num_pages} pages x "
                             f"{page_size} tokens = {capacity} tokens; set max_length <= {capacity}")
        log.warning("max_length lowered from %d to %d tokens: the KV cache holds %d pages of %d",
                    max_length, capacity, num_pages, page_size)
        max_length = capacity
    return max_length


def plan_memory(config: MiniMaxM2Config, args: EngineArgs,
                device_memory_gib: float | None = None) -> MemoryPlan:
    """Plan weights, activations and KV pages for ``args``'s deployment (docs/serving.md §7).

    ``device_memory_gib`` plans for devices of that size (GiB, per device) instead of measuring
    (hardware you do not have). Otherwise the free memory
    of the devices in ``args.devices`` is measured: CPU = available RAM (/proc/meminfo
    MemAvailable) shared by the N ranks of ``cpu:N``; GPU = free memory (torch.cuda.mem_get_info)
    of the smallest listed device, its total if it reports 0.

    Raises ValueError (:class:`EngineArgError`, naming the field) for any value
    :func:`check_engine_args` refuses — a deployment refused by validate_deployment (V1–V8, e.g. V7:
    NVFP4 experts under TP_TP with (I/tp) % 16 != 0), an unknown dtype / kv_cache_format /
    weight_dequant, a max_length not positive — and for an explicit max_length longer than the
    planned KV pool (stating the largest that fits);
    RuntimeError "model does not fit: ..." when weights + activations + scratch exceed the free
    memory, and "no room for KV cache: ..." when less than one page is left after
    device_memory_utilization.
    """
    dep = check_engine_args(config, args)
    P = num_devices(args.devices)
    encoding = checkpoint_encoding(config)
    act = dtype_bytes("dtype", args.dtype)
    kv_elem = dtype_bytes("kv_cache_format", args.kv_cache_format)
    S = args.kv_cache_page_size
    device_kind = "cpu" if args.devices.partition(":")[0] == "cpu" else "cuda"
    weight_dequant = resolve_weight_dequant(args.weight_dequant, device_kind, getattr(torch, args.dtype))

    state = dep.state(0)
    stored = _weight_bytes(config, state, encoding, act, packed=True)
    resident = stored if weight_dequant == "runtime" else _weight_bytes(config, state, encoding, act,
                                                                      packed=False)
    if dep.ep_size > 1:
        moe_act, ep_buf = ep_activation_bytes(
            config, args.max_batch_input_tokens, num_devices=P, ep_size=dep.ep_size,
            data_parallel_degree=dep.data_parallel_degree, ep_use_allreduce=dep.ep_use_allreduce,
            dispatch=args.dtype)
        activations = -(-(moe_act + ep_buf) // P)
    else:
        spec = parse_speculative_config(args.speculative_config)
        activations = dense_activation_bytes(
            config, args.max_batch_input_tokens, dep.max_batch_size, tp_size=dep.tp_size,
            split_experts=dep.mode is ParallelismMode.TP_TP, act_bytes=act,
            draft_tokens=spec.num_speculative_tokens if spec is not None else 0)
    scratch = MULTI_DEVICE_RESERVE if P > 1 else 0

    if device_memory_gib is not None:
        if device_memory_gib <= 0:
            raise ValueError(f"device_memory_gib={device_memory_gib} must be positive")
        free_bytes, source = int(device_memory_gib * GiB), f"--device-memory-gib {device_memory_gib:g}"
    else:
        free_bytes, source = measure_free_bytes(args.devices, P)

    util = args.device_memory_utilization
    static = resident + activations + scratch
    if static > free_bytes:
        hint = (" or weight_dequant=runtime (keep quantised weights packed)"
                if encoding is not Encoding.DENSE and weight_dequant == "load" else "")
        raise RuntimeError(
            f"model does not fit: weights {resident / GiB:.2f} GiB + activations {activations / GiB:.2f} GiB "
            f"+ scratch {scratch / GiB:.2f} GiB > free {free_bytes / GiB:.2f} GiB on device 0 "
            f"({dep.mode.value}, {P} device(s), {encoding.value} weights, "
            f"weight_dequant={weight_dequant}); use more devices (ep_size / tensor parallelism), "
            f"a smaller max_batch_input_tokens{hint}")
    budget = math.floor(free_bytes * util - static)
    kv_per_token = kv_bytes_per_token(config, dep.tp_size, kv_elem) + draft_kv_bytes_per_token(args, kv_elem)
    page = S * kv_per_token
    kv_source = _GPU_KV_SOURCE
    if args.devices.partition(":")[0] == "cpu":
        budget, kv_source = _cpu_kv_budget(config, args, dep.max_batch_size, page, budget)
    if budget < page:
        raise RuntimeError(
            f"no room for KV cache: free {free_bytes / GiB:.2f} GiB x device_memory_utilization={util} "
            f"- static {static / GiB:.2f} GiB (weights {resident / GiB:.2f} + activations "
            f"{activations / GiB:.2f} + scratch {scratch / GiB:.2f}) = {budget / GiB:.2f} GiB, less than one "
            f"KV page of {page / MiB:.2f} MiB ({S} tokens x {kv_per_token} B) at "
            f"device_memory_utilization={util}; raise device_memory_utilization, use more devices or "
            f"kv_cache_format=float8_e4m3fn")
    pages = budget // page
    max_length = fit_max_length(args.max_length, config.max_position_embeddings, pages, S)
    return MemoryPlan(
        mode=dep.mode, num_devices=P, tp_size=dep.tp_size, ep_size=dep.ep_size,
        data_parallel_degree=dep.data_parallel_degree, encoding=encoding.value, dtype=args.dtype,
        weight_dequant=weight_dequant, weight_bytes=resident, checkpoint_bytes=stored,
        activation_bytes=activations, scratch_bytes=scratch, free_bytes=free_bytes, memory_source=source,
        device_memory_utilization=util, kv_cache_format=args.kv_cache_format, kv_budget_bytes=budget,
        kv_bytes_per_token=kv_per_token, page_size=S, num_pages=pages, max_length=max_length,
        kv_source=kv_source, numerics=numerics_banner(args, config))


def cpu_kv_pool_bytes(config: MiniMaxM2Config, args: EngineArgs, max_batch_size: int,
                      page_bytes: int) -> tuple[int, str]:
    """The CPU KV pool per rank in bytes, and where the figure comes from (no memory is measured,
    so two starts give the same pages).

    ``args.kv_cache_memory_gib`` GiB when set, else min(4 GiB, min(``max_batch_size``,
    CPU_KV_DEFAULT_SEQUENCES) sequences of ``max_length`` tokens (args.max_length, else
    max_position_embeddings) in whole pages of ``page_bytes``). Raises ValueError for a
    kv_cache_memory_gib that is not a positive number.
    """
    gib = args.kv_cache_memory_gib
    if gib is not None:
        if isinstance(gib, bool) or not isinstance(gib, int | float) or not (math.isfinite(gib) and gib > 0):
            raise ValueError(f"kv_cache_memory_gib={gib!r} must be a positive number of GiB")
        return int(gib * GiB), f"--kv-cache-memory-gib {gib:g}"
    length = args.max_length or config.max_position_embeddings
    seqs = min(max_batch_size, CPU_KV_DEFAULT_SEQUENCES)
    need = seqs * -(-length // args.kv_cache_page_size) * page_bytes
    if need <= CPU_KV_DEFAULT_BYTES:
        return need, f"{seqs} sequences x max_length {length} (under the 4 GiB default)"
    return CPU_KV_DEFAULT_BYTES, "4 GiB CPU default (set --kv-cache-memory-gib for more)"


def _cpu_kv_budget(config: MiniMaxM2Config, args: EngineArgs, max_batch_size: int, page_bytes: int,
                   room: int) -> tuple[int, str]:
    """:func:`cpu_kv_pool_bytes`, checked against ``room`` (free RAM x utilisation - static bytes):
    an explicit size that does not fit raises RuntimeError naming both figures; the default is
    lowered to ``room`` with a warning (the only case where the page count follows free RAM)."""
    want, source = cpu_kv_pool_bytes(config, args, max_batch_size, page_bytes)
    if want <= room:
        return want, source
    if args.kv_cache_memory_gib is not None:
        raise RuntimeError(f"kv_cache_memory_gib={args.kv_cache_memory_gib:g} does not fit: "
                           f"{max(room, 0) / GiB:.2f} GiB of RAM is left for KV pages after the weights "
                           f"(device_memory_utilization={args.device_memory_utilization}); "
                           f"set kv_cache_memory_gib <= {max(room, 0) / GiB:.2f}")
    log.warning("CPU KV pool lowered from %.2f GiB (%s) to the %.2f GiB of RAM left", want / GiB, source,
                max(room, 0) / GiB)
    return room, f"{source}, lowered to the RAM left"


def kv_pool_bytes(config: MiniMaxM2Config, args: EngineArgs, num_pages: int, world_size: int) -> int:
    """Bytes of a pool of ``num_pages`` pages per rank for ``args``'s deployment on ``world_size``
    ranks (``args.devices``' count, or torchrun's WORLD_SIZE), for banners."""
    elem = dtype_bytes("kv_cache_format", args.kv_cache_format)
    tp = _deployment(config, args, world_size).tp_size
    return num_pages * args.kv_cache_page_size * (kv_bytes_per_token(config, tp, elem)
                                                   + draft_kv_bytes_per_token(args, elem))


def _deployment(config: MiniMaxM2Config, args: EngineArgs, world_size: int | None = None) -> Deployment:
    """config/parallel.py's validated deployment of ``args`` (rules V1–V10) on ``world_size``
    ranks (default: the devices of ``args.devices``)."""
    return validate_deployment(
        config, world_size or num_devices(args.devices), args.data_parallel_degree, args.ep_size,
        encoding=checkpoint_encoding(config).value, ep_use_allreduce=args.ep_use_allreduce,
        device_memory_utilization=args.device_memory_utilization, max_batch_size=args.max_batch_size,
        max_batch_input_tokens=args.max_batch_input_tokens)


def kv_bytes_per_token(config: MiniMaxM2Config, tp_size: int, elem_bytes: int) -> int:
    """2 (K, V) x L x (Hkv / tp) x D x elem_bytes: 253,952 B for the release in bf16 on one device,
    31,744 B per device at tp 8 (docs/model.md §4, docs/serving.md §7). fp8 KV scales (one per layer) are
    not counted."""
    kv_heads = config.num_key_value_heads // tp_size
    return 2 * config.num_hidden_layers * kv_heads * config.head_dim * elem_bytes


def draft_kv_bytes_per_token(args: EngineArgs, elem_bytes: int) -> int:
    """K and V bytes per token of an EAGLE-3 draft's layer in the pool (docs/serving.md §14):
    2 · num_key_value_heads · head_dim · elem_bytes of the draft's config.json; 0 without one.
    Raises ValueError naming the field for a bad speculative_config or draft config."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None or spec.method != "eagle3":
        return 0
    c = Eagle3DraftConfig.from_pretrained(spec.model)  # type: ignore[arg-type]
    return 2 * c.num_key_value_heads * c.head_dim * elem_bytes


def ep_activation_bytes(config: MiniMaxM2Config, max_batch_input_tokens: int, *, num_devices: int,
                        ep_size: int, data_parallel_degree: int, ep_use_allreduce: bool = False,
                        dispatch: str = "bfloat16") -> tuple[int, int]:
    """MAX's EP buffer estimate (docs/serving.md §7), summed over all devices: (moe_act, ep_buf) bytes.

    ``dispatch`` is the element type sent by EP dispatch: "fp8" (db 1), "fp4" (packed, db 1 and
    int(H/2 * 1.125) bytes per token, scales included), "bfloat16" / "float16" (db 2, what an
    implementation dispatching activations in bf16 sends) or "float32" (db 4).

        mt      = mbit if ep_use_allreduce else ceil(mbit / (ep_size / dp))
        recv    = mt * min(E, ep_size * k)
        moe_act = n * (recv*I*db + recv*H*2 + 256 MiB)
        per_dev = mt*tok + E*mt*tok (allreduce: (E/ep_size)*mt*tok) + k*mt*H*2
        ep_buf  = 2 * n * per_dev

    The multi-node combine-send term of MAX is not included.
    """
    db = {"fp8": 1, "fp4": 1, "bfloat16": 2, "float16": 2, "float32": 4}.get(dispatch)
    if db is None:
        raise ValueError(f"dispatch={dispatch!r}: use fp8, fp4, bfloat16, float16 or float32")
    H, I = config.hidden_size, config.intermediate_size
    E, k, n = config.num_local_experts, config.num_experts_per_tok, num_devices
    mbit = max_batch_input_tokens
    mt = mbit if ep_use_allreduce else math.ceil(mbit * data_parallel_degree / ep_size)
    recv = mt * min(E, ep_size * k)
    moe_act = n * (recv * I * db + recv * H * 2 + 256 * MiB)
    tok = int(H / 2 * 1.125) if dispatch == "fp4" else H * db
    experts_tok = (E // ep_size) * mt * tok if ep_use_allreduce else E * mt * tok
    per_dev = mt * tok + experts_tok + k * mt * H * 2
    return moe_act, 2 * n * per_dev


def dense_activation_bytes(config: MiniMaxM2Config, max_batch_input_tokens: int, max_batch_size: int, *,
                           tp_size: int, split_experts: bool, act_bytes: int, draft_tokens: int = 0) -> int:
    """Activation bytes of one step on one device without EP (TP_TP, or DP_EP with ep_size 1), an upper
    bound of one layer's live tensors plus the logits (docs/serving.md §7 "activations"):

        T = max_batch_input_tokens, a = act_bytes, tp = tp_size, I_r = I / tp (split_experts) else I,
        R = min(T, max_batch_size x (1 + draft_tokens))       rows sampled in a step
        hidden = 2 T H a                                        residual stream + normed layer input
        attn   = T (2 Hq + 2 Hkv) D / tp a                      q, k, v, attention output
        moe    = T E 4 + T k (3 I_r + H) a                      fp32 router logits; per routed row gate
                                                                and up (2 I_r), their product, down (H)
        logits = R V 4                                          fp32 logits of the sampled rows
        bytes  = hidden + max(attn, moe) + logits

    Bytes (int). The release (H 3072, Hq 48, Hkv 8, D 128, E 256, k 8, I 1536, V 200,064) in bf16 at
    T 8192 and 256 sequences: 1,320,550,400 B (1.23 GiB) on one device, 792,068,096 B (0.74 GiB) per
    device under TP_TP tp 8.
    """
    T, a, tp = max_batch_input_tokens, act_bytes, tp_size
    H, D, V = config.hidden_size, config.head_dim, config.vocab_size
    E, k = config.num_local_experts, config.num_experts_per_tok
    I_r = config.intermediate_size // tp if split_experts else config.intermediate_size
    rows = min(T, max_batch_size * (1 + draft_tokens))
    hidden = 2 * T * H * a
    attn = T * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * D // tp * a
    moe = T * E * 4 + T * k * (3 * I_r + H) * a
    return hidden + max(attn, moe) + rows * V * 4


def checkpoint_encoding(config: MiniMaxM2Config) -> Encoding:
    """The checkpoint's weight encoding from its quantization_config (formats/detect.py; ValueError /
    NotImplementedError from there for unsupported quantisation)."""
    return detect_encoding(config.quantization_config, config.source)


def _weight_bytes(config: MiniMaxM2Config, state, encoding: Encoding, act: int, *, packed: bool) -> int:
    """Per-rank weight bytes: parallel/shard.py's tensor list sliced by the rank's shard plan.

    packed=True: as stored (FP8: 1 B + fp32 128x128 scales; FP4 experts: U8 nibbles + group scales,
    NVFP4 also two fp32 per-tensor scalars). packed=False: every quantised linear dequantised to the
    compute dtype (``act`` bytes). Router gate + bias are fp32, norms / embedding / lm_head ``act``.
    """
    if encoding is Encoding.FP8_BLOCK and packed:
        return rank_weight_bytes(config, state, "fp8", act)
    dense = rank_weight_bytes(config, state, "bf16", act)
    if not packed or encoding not in (Encoding.NVFP4, Encoding.MXFP4):
        return dense
    # FP4 releases quantise only the experts (docs/checkpoints.md §7): swap their dense bytes for packed.
    r = shard_ranges(config, state)
    held = (r.experts[1] - r.experts[0]) * config.num_hidden_layers * 3      # expert linears on this rank
    n_k = config.hidden_size * (r.intermediate[1] - r.intermediate[0])       # elements of one linear
    group, scale_b, scalars = (NVFP4_GROUP, 1, 8) if encoding is Encoding.NVFP4 else (MXFP4_GROUP, 1, 0)
    packed_one = n_k // 2 + n_k // group * scale_b + scalars
    return dense - held * n_k * act + held * packed_one


def num_devices(devices: str) -> int:
    """World size of an EngineArgs.devices string: cpu / gpu -> 1, cpu:N -> N, gpu:0,1,2 -> 3.
    Raises ValueError naming the accepted forms (config.engine_args.rank_devices)."""
    return len(rank_devices(devices))


def measure_free_bytes(devices: str, num: int) -> tuple[int, str]:
    """(free bytes per device, where the figure came from) for an EngineArgs.devices string.

    CPU: MemAvailable from /proc/meminfo (else os.sysconf available pages) divided by the number
    of CPU ranks, which share the RAM. GPU: the smallest torch.cuda.mem_get_info free figure of
    the listed devices (a device reporting 0 counts with its total). RuntimeError if no CUDA
    device is visible, suggesting --device-memory-gib.
    """
    kind, _, rest = devices.partition(":")
    if kind == "cpu":
        avail = _available_ram()
        return avail // num, f"available RAM {avail / GiB:.2f} GiB / {num} CPU rank(s)"

    if not torch.cuda.is_available():
        raise RuntimeError(f"devices={devices!r}: no CUDA device is visible; plan for hardware you do not "
                           f"have with --device-memory-gib")
    ids = [int(d) for d in rest.split(",")] if rest else [0]
    frees = []
    for i in ids:
        free, total = torch.cuda.mem_get_info(i)
        frees.append(free or total)
    return min(frees), f"free GPU memory (smallest of {len(ids)} device(s))"


def _available_ram() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a two-column text table (per device), for ``m2serve plan``."""
    def gib(b: int) -> str:
        return f"{b / GiB:,.2f} GiB ({b:,} B)"

    rows = [
        ("parallel mode", f"{plan.mode.value}: {plan.num_devices} device(s), tp {plan.tp_size}, "
                          f"ep {plan.ep_size}, dp {plan.data_parallel_degree}"),
        ("weights", f"{plan.encoding}, compute {plan.dtype}, weight_dequant {plan.weight_dequant}"),
        ("numerics", plan.numerics),
        ("weight bytes / device", gib(plan.weight_bytes)),
        ("  held packed (as stored)", gib(plan.checkpoint_bytes)),
        ("activations / device", gib(plan.activation_bytes)),
        ("scratch / device", gib(plan.scratch_bytes)),
        ("device memory", f"{gib(plan.free_bytes)} [{plan.memory_source}]"),
        ("memory utilization", f"{plan.device_memory_utilization:g}"),
        ("KV budget / device", f"{gib(plan.kv_budget_bytes)} [{plan.kv_source}]"),
        ("KV bytes / token / device", f"{plan.kv_bytes_per_token:,} B ({plan.kv_cache_format})"),
        ("KV pages / replica", f"{plan.num_pages:,} x {plan.page_size} tokens = {plan.kv_tokens:,} tokens"),
        ("KV pages, deployment", f"{plan.data_parallel_degree} replica(s) x {plan.num_pages:,} = "
                                 f"{plan.data_parallel_degree * plan.num_pages:,} pages "
                                 f"({plan.data_parallel_degree * plan.kv_tokens:,} tokens)"),
        ("max context (max_length)", f"{plan.max_length:,} tokens"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
