"""Fixtures of the serve tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_random_dir):
    from m2serve.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_random_dir)
