"""kernels/memory.py: huge pages asked for the weights' storages (docs/kernels.md §6)."""

from __future__ import annotations

import sys

import torch

from m2serve.kernels.memory import HUGE_PAGE, advise_huge_pages


def _whole_pages(t: torch.Tensor) -> int:
    # the whole 2 MiB pages inside [ptr, ptr + nbytes), by hand
    ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    first = (ptr + HUGE_PAGE - 1) // HUGE_PAGE
    last = (ptr + n) // HUGE_PAGE
    return max(last - first, 0) * HUGE_PAGE


def test_advises_the_whole_huge_pages_of_each_storage_once():
    assert sys.platform.startswith("linux")  # this machine and CI
    big = torch.empty(9 * HUGE_PAGE + 12345, dtype=torch.uint8)  # untouched, as load_model's parameters
    other = torch.empty(3 * HUGE_PAGE, dtype=torch.bfloat16)
    small = torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)  # under one huge page: skipped
    want = _whole_pages(big) + _whole_pages(other)
    assert want >= 8 * HUGE_PAGE + 5 * HUGE_PAGE  # at most one page lost at each unaligned end
    # views of one storage count once; a meta tensor has no memory
    got = advise_huge_pages([big, big[100:], other, other.view(-1)[:10], small,
                             torch.empty(4 * HUGE_PAGE, device="meta")])
    assert got == want


def test_load_model_advises_every_parameter_before_filling(tiny_random_dir, monkeypatch):
    # load_model asks once, right after allocating the parameters (before the checkpoint fills them):
    # every parameter of the loaded model is among the storages asked for (they keep their storages)
    from m2serve.model import load as load_mod

    asked = []
    real = load_mod.advise_huge_pages

    def spy(tensors):
        tensors = list(tensors)
        asked.append({t.untyped_storage().data_ptr() for t in tensors})
        return real(tensors)

    monkeypatch.setattr(load_mod, "advise_huge_pages", spy)
    model = load_mod.load_model(tiny_random_dir, dtype=torch.bfloat16)
    assert len(asked) == 1
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= asked[0]
