"""The repo's copy of the acceptance case files equals ../shared/cases whenever that folder exists.

A user's clone has no ../shared, so the tests read tests/data/; this test keeps the copy honest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "cases"
FILES = ("parser_cases.jsonl", "template_cases.jsonl", "README.md")


@pytest.mark.parametrize("name", FILES)
def test_copy_present(name):
    assert (DATA / name).is_file() and (DATA / name).stat().st_size > 0


@pytest.mark.parametrize("name", FILES)
def test_copy_equals_shared(name):
    shared = SHARED / name
    if not SHARED.is_dir():
        return  # a user's clone: only the copy exists (checked above)
    assert shared.is_file(), f"{shared} disappeared from ../shared/cases"
    assert (DATA / name).read_bytes() == shared.read_bytes(), f"tests/data/{name} differs from {shared}"
