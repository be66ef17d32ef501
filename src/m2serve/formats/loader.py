"""Strict, streaming state-dict loading (docs/checkpoints.md §1, §3, §4, §6).

:func:`plan_checkpoint` checks every header against the config before any data is read
(missing / unknown / wrong-shape tensors, unsupported encodings); :func:`iter_weights` then
yields one ready tensor at a time (dense, in the compute dtype; router in fp32), so peak memory
stays near the final model size. Every linear weight goes through :func:`dequantize_linear`,
the one dispatch point per storage kind.

Every tensor read (weights, norms, scales, FP8 codes, KV scales) is tested for NaN / inf codes on
its stored bytes while it is copied out of the file (CheckpointReader.read, formats/finite.py);
a corrupt one raises CorruptTensorError naming the file and tensor.

Shard hook: ``plan(name, global_shape)`` returns None (whole tensor), ``"skip"`` (not on this
rank) or ``(dim, start, end)`` (read only that slice; an FP8 slice may start inside a 128-wide
scale band: it keeps the bands it touches and its offset, docs/checkpoints.md §6).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.formats import names
from m2serve.formats.detect import (
    FP8_BLOCK,
    LinearKind,
    QuantSpec,
    checkpoint_quant_config,
    detect_quant,
    linear_kind,
)
from m2serve.formats.finite import CopyCheck, copy_check_torch
from m2serve.formats.fp4 import FP4Scheme, PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.formats.safetensors_io import CheckpointReader, TensorInfo

log = logging.getLogger(__name__)

Slice = tuple[int, int, int]
ShardPlan = Callable[[str, tuple[int, ...]], Slice | None | Literal["skip"]]


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the config: missing, unknown or wrong-shape tensors."""


@dataclass(slots=True)
class LoadPlan:
    """What :func:`iter_weights` will read: canonical name -> file tensor, companions, kinds."""

    reader: CheckpointReader
    config: MiniMaxM2Config
    files: dict[str, str] = field(default_factory=dict)  # canonical name -> name in the file
    companions: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)
    kinds: dict[str, LinearKind] = field(default_factory=dict)
    kv_scales: dict[tuple[int, str], str] = field(default_factory=dict)  # (layer, "k"|"v") -> name
    quant: QuantSpec | None = None  # checkpoint-level quantisation (formats/detect.py)


def plan_checkpoint(reader: CheckpointReader, config: MiniMaxM2Config) -> LoadPlan:
    """Match the checkpoint's headers against ``config`` (docs/checkpoints.md §3.7 strictness).

    Raises CheckpointMismatchError listing (first 10) missing tensors, leftover unknown tensors
    or shape mismatches (tensor, expected vs found); ValueError / NotImplementedError from
    encoding detection.
    """
    quant = detect_quant(*checkpoint_quant_config(reader.path, config.quantization_config, config.source))
    expected = names.expected_shapes(config)
    plan = LoadPlan(reader, config, quant=quant)
    unknown: list[str] = []
    dropped: dict[str, int] = {}
    companions: dict[str, dict[str, TensorInfo]] = {}
    for fname, info in reader.tensors.items():
        reason = names.drop_reason(fname, config.num_hidden_layers)
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        kv = names.kv_scale_of(fname)
        if kv is not None:
            plan.kv_scales[kv] = fname
            continue
        comp = names.split_companion(fname)
        if comp is not None:
            companions.setdefault(names.canonical_name(comp[0]), {})[comp[1]] = info
            continue
        # compressed-tensors names a packed FP4 weight X.weight_packed (docs/checkpoints.md §4)
        canon = names.canonical_name(fname[: -len("_packed")] if fname.endswith(".weight_packed") else fname)
        if canon not in expected:
            unknown.append(fname)
        elif canon in plan.files:
            raise CheckpointMismatchError(f"tensor {canon} appears twice ({plan.files[canon]} and {fname})")
        else:
            plan.files[canon] = fname
    if dropped:
        log.debug("dropped tensors: %s", dropped)
    for weight, comps in companions.items():
        if weight not in plan.files or not names.is_linear(weight):
            unknown.extend(c.name for c in comps.values())
    if unknown:
        raise CheckpointMismatchError(
            f"{reader.path}: {len(unknown)} unknown tensor(s) not used by a MiniMax-M2 model with "
            f"this config: {', '.join(sorted(unknown)[:10])}")
    missing = [n for n in expected if n not in plan.files
               and (config.use_routing_bias or not n.endswith("e_score_correction_bias"))]
    if missing:
        raise CheckpointMismatchError(
            f"{reader.path}: {len(missing)} required tensor(s) missing: {', '.join(missing[:10])}")
    for canon, fname in plan.files.items():
        info = reader.tensors[fname]
        if logical_shape(info) != expected[canon]:
            raise CheckpointMismatchError(
                f"{info.file.name}: tensor {fname} has shape {list(info.shape)}"
                f"{' (packed FP4, K/2 columns)' if info.dtype == 'U8' else ''}, expected "
                f"{list(expected[canon])} from {config.source}")
        if names.is_linear(canon):
            plan.companions[canon] = companions.get(canon, {})
            plan.kinds[canon] = linear_kind(info, plan.companions[canon])
            quant.check_linear(fname.rsplit(".", 1)[0], plan.kinds[canon])
        elif canon in companions:
            raise CheckpointMismatchError(f"{fname} is not a linear weight but has scale tensors")
    return plan


def dequantize_linear(plan: LoadPlan, name: str, dtype: torch.dtype, rows: tuple[int, int] | None = None,
                      cols: tuple[int, int] | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Dense [N', K'] weight of linear ``name`` (canonical) in ``dtype``, optionally a slice.

    ``device`` (default: where the reader puts it, the host) is where a quantised weight is
    dequantised: its codes and scales move there as stored, then the formula runs there, so a GPU
    target never dequantises on the host (the result is on ``device``; a dense weight is only cast,
    on the host, and the model copies it).

    The one dispatch point per linear storage kind (docs/checkpoints.md §4): dense -> cast; FP8 block
    -> fp32 e4m3 x scale_inv product, one rounding (docs/checkpoints.md §6); NVFP4 / MXFP4 ->
    :func:`packed_linear` then its scheme's fp32 formula, one rounding (docs/checkpoints.md §6,
    formats/fp4.py). ``rows`` / ``cols`` are ``(start, end)`` ranges (FP8: any start, :func:`packed_fp8`).
    """
    fname = plan.files[name]
    kind = plan.kinds[name]
    if kind is LinearKind.DENSE:
        return plan.reader.read(fname, rows, cols).to(dtype)
    if kind is LinearKind.FP8_BLOCK:
        return dequantize_in_bands(to_device(packed_fp8(plan, name, rows, cols), device), dtype)
    return dequantize_in_bands(to_device(packed_linear(plan, name, rows, cols), device), dtype)


def to_device(packed: PackedFP8 | PackedFP4, device: torch.device | str | None) -> PackedFP8 | PackedFP4:
    """``packed`` with its codes and scales on ``device`` as stored (no conversion); itself for None."""
    if device is None:
        return packed
    if isinstance(packed, PackedFP8):
        return PackedFP8(packed.q.to(device), packed.scale.to(device), packed.name, packed.row0, packed.col0)
    s2 = None if packed.scale_2 is None else packed.scale_2.to(device)
    return PackedFP4(packed.scheme, packed.packed.to(device), packed.scale.to(device), s2, packed.name)


#: Rows of a quantised weight dequantised at a time at load: one row of the FP8 scale grid.
DEQUANT_BAND_ROWS = FP8_BLOCK


def dequantize_in_bands(packed: PackedFP8 | PackedFP4, dtype: torch.dtype) -> torch.Tensor:
    """``packed.dequantize(dtype)`` (dense [N, K], on the codes' device), computed DEQUANT_BAND_ROWS
    rows at a time into one output: equal values (every formula is per row), but the fp32
    temporaries are a band's (~1.5 MiB at K = 3,072, reused from the heap) instead of whole [N, K]
    ones per weight (three fp32 tensors for FP8, 12 bytes per weight), whose fresh pages the kernel
    zeroes on every load. ValueError as ``packed.rows`` (a scale that does not fit the whole weight)
    or its ``dequantize``."""
    n, k = packed.shape
    codes = packed.q if isinstance(packed, PackedFP8) else packed.packed
    out = torch.empty((n, k), dtype=dtype, device=codes.device)
    for start in range(0, n, DEQUANT_BAND_ROWS):
        end = min(n, start + DEQUANT_BAND_ROWS)
        out[start:end] = packed.rows(start, end).dequantize(dtype)
    return out


_FP4_SCHEMES = {LinearKind.NVFP4: FP4Scheme.NVFP4_MODELOPT, LinearKind.NVFP4_CT: FP4Scheme.NVFP4_CT,
                LinearKind.MXFP4: FP4Scheme.MXFP4}


def logical_shape(info: TensorInfo) -> tuple[int, ...]:
    """The unpacked shape of a tensor: U8 packed FP4 [N, K/2] -> [N, K]; others as stored."""
    if info.dtype == "U8" and len(info.shape) == 2:
        return info.shape[0], 2 * info.shape[1]
    return info.shape


def packed_linear(plan: LoadPlan, name: str, rows: tuple[int, int] | None = None,
                  cols: tuple[int, int] | None = None) -> PackedFP4:
    """FP4 linear ``name`` (canonical) as read from the file, still packed (docs/checkpoints.md §6).

    ``rows`` / ``cols`` are ``(start, end)`` in unpacked coordinates; ``cols`` must be aligned to
    the scheme's group (16 NVFP4, 32 MXFP4), else ValueError naming the tensor. The per-tensor
    scalar (``weight_scale_2`` or ``weight_global_scale``) is read in fp32.
    """
    fname, comps = plan.files[name], plan.companions[name]
    scheme = _FP4_SCHEMES[plan.kinds[name]]
    g = scheme.group
    if cols is not None and (cols[0] % g or cols[1] % g):
        raise ValueError(f"{fname}: FP4 column slice {list(cols)} is not aligned to the group size {g}")
    pcols = (cols[0] // 2, cols[1] // 2) if cols else None
    scols = (cols[0] // g, cols[1] // g) if cols else None
    second = comps.get("weight_scale_2") or comps.get("weight_global_scale")
    packed = plan.reader.read(fname, rows, pcols)  # E2M1 nibbles: every code is finite
    scale = plan.reader.read(comps["weight_scale"].name, rows, scols,
                             "e8m0" if scheme is FP4Scheme.MXFP4 else "e4m3")
    scalar = plan.reader.read(second.name).float() if second else None
    return PackedFP4(scheme, packed, scale, scalar, fname)


def packed_fp8(plan: LoadPlan, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> PackedFP8:
    """FP8 block linear ``name`` (canonical) as read from the file: e4m3 codes and the fp32 scale
    grid of the blocks covering the slice (docs/checkpoints.md §6). ``rows`` / ``cols`` may start
    inside a 128-wide band (a TP slice such as 192 of 1,536 rows): the scale rows / columns read are
    the bands the slice touches, ``[start // 128, ceil(end / 128))``, and the result's ``row0`` /
    ``col0`` is ``start % 128``."""
    fname = plan.files[name]
    scale = plan.companions[name].get("weight_scale_inv") or plan.companions[name]["weight_scale"]
    srows, scols = (_block_range(r) if r else None for r in (rows, cols))
    q = plan.reader.read(fname, rows, cols, "e4m3")
    return PackedFP8(q, plan.reader.read(scale.name, srows, scols).float(), fname,
                     rows[0] % FP8_BLOCK if rows else 0, cols[0] % FP8_BLOCK if cols else 0)


def _block_range(r: tuple[int, int]) -> tuple[int, int]:
    start, end = r
    return start // FP8_BLOCK, -(-end // FP8_BLOCK)


def iter_weights(plan: LoadPlan, dtype: torch.dtype, shard: ShardPlan | None = None,
                 progress: bool | None = None, packed: bool = False,
                 device: torch.device | str | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor | PackedFP4 | PackedFP8]]:
    """Yield ``(canonical name, tensor)`` one at a time, ready for the model.

    Linear weights: dense ``dtype`` via :func:`dequantize_linear`, except when ``packed``
    (``--weight-dequant runtime``): FP8 block linears come as :class:`PackedFP8` (:func:`packed_fp8`)
    and FP4 expert weights as :class:`PackedFP4` (:func:`packed_linear`), dequantised later when
    used (per forward, per active expert). ``device`` is the model's device: a quantised weight
    that is dequantised here is dequantised THERE (:func:`dequantize_linear`), never on the host
    for a GPU target; packed weights come as read (the model copies them to its device as
    stored). Router gate and correction
    bias: float32 whatever the file holds (docs/model.md §5.1). Everything else: ``dtype``.
    ``shard`` is the rank's slice hook (module docstring). Raises CorruptTensorError for a
    tensor (or scale) holding NaN / inf, before it reaches the model. A tqdm bar counts bytes read; it is
    shown when ``progress`` is True, or by default when stderr is a terminal.
    """
    show = sys.stderr.isatty() if progress is None else progress
    reader = plan.reader
    total = sum(reader.tensors[f].nbytes for f in plan.files.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show) as bar:
        for canon, fname in plan.files.items():
            info = reader.tensors[fname]
            sl = shard(canon, logical_shape(info)) if shard else None
            if sl == "skip":
                bar.update(info.nbytes)
                continue
            rows = cols = None
            if sl is not None:
                dim, start, end = sl
                rows, cols = ((start, end), None) if dim == 0 else (None, (start, end))
            kind = plan.kinds.get(canon)
            if packed and kind is LinearKind.FP8_BLOCK:
                t = packed_fp8(plan, canon, rows, cols)
            elif packed and kind in _FP4_SCHEMES and ".experts." in canon:
                t = packed_linear(plan, canon, rows, cols)
            elif canon in plan.kinds:
                t = dequantize_linear(plan, canon, dtype, rows, cols, device)
            else:
                target = torch.float32 if names.is_router(canon) else dtype
                t = reader.read(fname, rows, cols).to(target)
            bar.update(info.nbytes)
            yield canon, t


def read_kv_scales(plan: LoadPlan) -> tuple[list[float], list[float]] | None:
    """Per-layer (k_scale, v_scale) from the checkpoint, 1.0 where absent; None if it has none."""
    if not plan.kv_scales:
        return None
    L = plan.config.num_hidden_layers
    k, v = [1.0] * L, [1.0] * L
    for (layer, which), fname in plan.kv_scales.items():
        val = float(plan.reader.read(fname).float().reshape(-1)[0])
        (k if which == "k" else v)[layer] = val
    return k, v


def read_input_scales(plan: LoadPlan) -> dict[str, float]:
    """NVFP4 activation scales per FP4 linear (canonical name -> fp32 value), for a future W4A4 path.

    ModelOpt ``input_scale`` as stored; compressed-tensors ``input_global_scale`` inverted (it is
    1 / input_scale, docs/checkpoints.md §4). A linear without one gets 1.0, but only when the
    checkpoint has at least one (calibration never routed tokens to a few experts;
    docs/checkpoints.md §3.3). Empty when the checkpoint has none. The weight-only path ignores these values.
    """
    found: dict[str, float] = {}
    for canon, comps in plan.companions.items():
        if "input_scale" in comps:
            found[canon] = float(plan.reader.read(comps["input_scale"].name).float().reshape(-1)[0])
        elif "input_global_scale" in comps:
            inv = plan.reader.read(comps["input_global_scale"].name).float().reshape(-1)[0]
            found[canon] = 1.0 / float(inv)
    if not found:
        return {}
    nvfp4 = (LinearKind.NVFP4, LinearKind.NVFP4_CT)
    missing = [c for c, k in plan.kinds.items() if k in nvfp4 and c not in found]
    if missing:
        log.debug("%d NVFP4 linear(s) without input_scale, recorded as 1.0 (first: %s)",
                  len(missing), missing[0])
    return {**found, **dict.fromkeys(missing, 1.0)}


def open_checkpoint(path: str | Path, config: MiniMaxM2Config,
                    copy_check: CopyCheck = copy_check_torch) -> LoadPlan:
    """Open ``path`` (reads copied and tested by ``copy_check``, formats/finite.py) and plan its load
    (see :func:`plan_checkpoint`)."""
    return plan_checkpoint(CheckpointReader(path, copy_check), config)
