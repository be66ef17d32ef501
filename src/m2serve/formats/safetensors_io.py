"""Safetensors checkpoint access: which files, which tensors, header facts, sliced reads.

docs/checkpoints.md §1: with ``model.safetensors.index.json`` exactly the files named in its
``weight_map`` are read (a stray ``*.safetensors`` beside them is ignored); without an index, a
single ``model.safetensors``. Headers are parsed and checked against the file size before any
data is read, so a truncated or corrupt file fails with its name instead of a late crash. Reads copy
out of a memory map of the file and test the bytes for non-finite codes in the same pass
(formats/finite.py).
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from m2serve.formats.finite import CopyCheck, Encoding, copy_check_torch, copy_finite

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Header dtypes accepted (docs/checkpoints.md §1); everything else is an error naming the tensor.
HEADER_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8,
}
#: The float header dtypes a dense tensor (or an FP8 scale) may have.
FLOAT_HEADER_DTYPES = ("BF16", "F16", "F32")
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointFormatError(ValueError):
    """A weight file is missing, truncated or corrupt, or its index is inconsistent."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as its header describes it: ``dtype`` is the header string (e.g. ``"F8_E4M3"``);
    ``offset``: where its data starts in the file (bytes)."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header (8-byte little-endian length, JSON, data).

    Raises CheckpointFormatError naming the file when the header is unreadable, a tensor's byte
    range does not match its dtype x shape, or the data section is shorter than the header says
    (truncated file); the error names the tensor and expected vs found byte counts.
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointFormatError(
                f"{file}: corrupt or truncated safetensors header (declares {n} header bytes, "
                f"file has {size})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{file}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(
            f"{file}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            if not all(_index_int(v) for v in (*shape, start, end)) or start > end:
                raise ValueError("shape and data_offsets must be non-negative integers, start <= end")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{file}: corrupt header entry for tensor {name!r} ({e})") from e
        if dtype not in HEADER_DTYPES:
            raise CheckpointFormatError(
                f"{file}: tensor {name!r} has unsupported dtype {dtype} "
                f"(supported: {', '.join(HEADER_DTYPES)})")
        numel = 1
        for d in shape:
            numel *= d
        want = numel * HEADER_DTYPES[dtype].itemsize
        if end - start != want:
            raise CheckpointFormatError(
                f"{file}: tensor {name!r} spans {end - start} bytes but dtype {dtype} x shape "
                f"{list(shape)} needs {want}")
        if end > data_len:
            raise CheckpointFormatError(
                f"{file}: truncated: tensor {name!r} ends at data byte {end} but the file holds "
                f"only {data_len} data bytes")
        out[name] = TensorInfo(name, file, dtype, shape, want, 8 + n + start)
    return out


def _index_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory, in index order (docs/checkpoints.md §1).

    Raises FileNotFoundError naming a shard the index lists but the directory lacks, or the
    directory when it has neither an index nor ``model.safetensors``.
    """
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map must map tensor names to shard file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name}, which does not exist in {path}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")


class CheckpointReader:
    """Headers of every weight file of a checkpoint and sliced, tensor-by-tensor reads.

    ``tensors`` maps each name to its :class:`TensorInfo`. With an index, every name it lists
    must be in the named shard's header and no name may appear in two shards (else
    CheckpointFormatError naming both). ``copy_check`` copies and tests the bytes of each read
    (formats/finite.py; kernels/ops.py passes the C++ op). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | Path, copy_check: CopyCheck = copy_check_torch):
        self.path = Path(path)
        self.copy_check = copy_check
        self.files = checkpoint_files(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise CheckpointFormatError(
                        f"tensor {name!r} appears in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = info
        index = self.path / INDEX_FILE
        if index.is_file():
            for name, fname in json.loads(index.read_text())["weight_map"].items():
                info = self.tensors.get(name)
                if info is None or info.file.name != fname:
                    raise CheckpointFormatError(
                        f"{index} maps tensor {name!r} to {fname}, but that shard's header does "
                        f"not contain it")
        self._maps: dict[Path, mmap.mmap] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the file maps (each is unmapped once no tensor view of it is left)."""
        self._maps.clear()

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None, encoding: Encoding | None = None) -> torch.Tensor:
        """The tensor ``name`` as stored (CPU, header dtype, a copy), optionally only ``[start, end)``
        of dim 0 (``rows``) and/or dim 1 (``cols``), tested for non-finite codes while it is copied
        (``encoding`` as for formats/finite.py; U8 without one, e.g. packed E2M1, is not tested).

        Raises KeyError naming the tensor if absent; CheckpointFormatError naming the file if the
        data cannot be read; CorruptTensorError naming the file and tensor for NaN / inf / NaN codes.
        """
        info = self.tensors[name]
        try:
            view = self._view(info)
        except (OSError, ValueError) as e:
            raise CheckpointFormatError(f"{info.file}: cannot read tensor {name!r}: {e}") from e
        if rows is not None:
            view = view[slice(*rows)]
        if cols is not None:
            view = view[:, slice(*cols)]
        out = copy_finite(view, name, self.copy_check, encoding, where=info.file.name)
        self._release(info)
        return out

    def _release(self, info: TensorInfo) -> None:
        """Unmap ``info``'s file pages from this process once its bytes are copied (madvise
        MADV_DONTNEED on the read-only shared map: the pages stay in the page cache, a later read
        faults them back in). Without it every page read stayed mapped, counted in the process's
        resident set, until :meth:`close`: loading the 2.2 GiB bf16 bench checkpoint peaked at
        4.7 GiB RSS, the copies plus the whole file mapped."""
        mm = self._maps.get(info.file)
        if mm is None or info.nbytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def _view(self, info: TensorInfo) -> torch.Tensor:
        """``info``'s tensor as a view of the mapped file (no copy; read-only use)."""
        dtype = HEADER_DTYPES[info.dtype]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        mm = self._maps.get(info.file)
        if mm is None:
            # read-only: a private writable map (ACCESS_COPY) is charged in full to the kernel's
            # committed memory, which fails a large checkpoint under vm.overcommit_memory=2
            with open(info.file, "rb") as fh:
                mm = self._maps[info.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        # torch has no read-only tensors and warns about one; this view is only ever copied from
        # (copy_finite), never written
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset))
        return raw.view(dtype).view(info.shape)
