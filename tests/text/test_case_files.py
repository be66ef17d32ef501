"""The acceptance case files live in the repository (tests/data/): they are complete and well formed.

tests/text/test_parser_cases.py and tests/text/test_template.py run every case of these files, and
tests/data/README.md describes their fields. The repository copy is the reference: nothing here
reads a folder outside the clone, so no test passes because a folder is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
FIELDS = {
    "parser_cases.jsonl": {"id", "source", "prompt_tail", "mode", "tools", "output", "expect"},
    "template_cases.jsonl": {"id", "source", "messages", "tools", "add_generation_prompt", "expect_contains",
                             "expect_not_contains", "expect_endswith"},
}


def _cases(name: str) -> list[dict]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_field_description_is_there():
    text = (DATA / "README.md").read_text(encoding="utf-8")
    assert all(name in text for name in FIELDS)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_case_has_its_fields_and_a_unique_id(name):
    cases = _cases(name)
    assert len(cases) >= 5, f"tests/data/{name}: only {len(cases)} cases"
    for case in cases:
        missing = FIELDS[name] - set(case)
        assert not missing, f"tests/data/{name} case {case.get('id')}: missing {sorted(missing)}"
    ids = [c["id"] for c in cases]
    assert len(set(ids)) == len(ids), f"tests/data/{name}: duplicate ids"


def test_parser_cases_expect_the_three_parts():
    for case in _cases("parser_cases.jsonl"):
        assert {"reasoning", "content", "tool_calls"} <= set(case["expect"]), case["id"]
        assert case["mode"] in ("split", "passthrough"), case["id"]
