"""Transparent huge pages for the weights the CPU kernels stream (docs/kernels.md §6).

A batch-1 decode step reads every weight once, front to back. With 4 KiB pages the CPU's hardware
prefetchers stop at each page boundary and every 4 KiB costs a TLB entry; with 2 MiB pages they run
on. Linux hands a process huge pages for anonymous memory where it asks (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``) if it
asks before the pages are first touched. :func:`advise_huge_pages` asks for the storages of freshly
allocated (not yet filled) weights; model/load.py calls it once, right after the model's parameters
are allocated and before the checkpoint fills them.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterable

import torch

#: Bytes of one x86-64 transparent huge page.
HUGE_PAGE = 2 << 20
#: ``MADV_HUGEPAGE`` of Linux ``<sys/mman.h>``.
MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc ``madvise`` with its argument types, or None off Linux (or without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """``madvise(MADV_HUGEPAGE)`` the whole 2 MiB pages inside each distinct CPU storage behind
    ``tensors`` (a storage smaller than that, or on another device, is skipped; views of one storage
    count once). Pages touched before the call keep their size, so call it before filling. Returns
    the bytes advised (0 off Linux, or where the kernel refuses); never raises for a refusal."""
    advise = _madvise()
    if advise is None:
        return 0
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in seen or nbytes < HUGE_PAGE:
            continue
        seen.add(ptr)
        start = -(-ptr // HUGE_PAGE) * HUGE_PAGE
        end = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start and advise(start, end - start, MADV_HUGEPAGE) == 0:
            total += end - start
    return total
