"""Every rule and section the code cites is described in docs/ (the repository explains itself).

Collected from every ``.py`` and ``.jinja`` file under src/, the ``.py`` files of tests/ and
benchmarks/ (this file excepted: its examples are stale on purpose), every text file under tools/
and recipes/, and README.md: rule ids (parser rules P1–P26 of
docs/parsers.md, validation rules V1–V10 of docs/parallelism.md) and section references written
``docs/<page>.md §N`` (also lists such as ``§1, §3`` and ranges ``§6–§7``). Each must resolve: the
page exists and has a heading ``§N`` (rules: a bold ``**P13**`` definition). References to the old
spec names (``serving.md §7``, ``spec/chat-and-parsers.md``) without ``docs/`` fail with the docs/
name to write instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "m2serve"
DOCS = ROOT / "docs"
TEXT_SUFFIXES = {".py", ".jinja", ".md", ".yaml", ".yml", ".json", ".txt", ".sh", ".toml"}

RULE = re.compile(r"\b([PV])(\d{1,2})\b")
SECTION_TAIL = r"((?:\s*(?:,|-|–|and)\s*§\s*\d+(?:\.\d+)?)*)"
DOC_REF = re.compile(r"docs/([a-z-]+)\.md\s*§\s*(\d+(?:\.\d+)?)" + SECTION_TAIL)
# A spec page name not prefixed by docs/ (the documents the code used to cite, outside the repository).
BARE_REF = re.compile(r"(?<![\w/.-])(?:spec/|spec )?(model|checkpoints|serving|chat-and-parsers|parsers|"
                      r"parallelism)\.md(\s*§\s*(\d+))?")
RULE_HOME = {"P": "parsers", "V": "parallelism"}


def _sources() -> list[Path]:
    """src/'s code, then the other places that cite docs/ (module docstring)."""
    return sorted(p for p in SRC.rglob("*") if p.suffix in (".py", ".jinja"))


def _cited_files() -> list[Path]:
    here = Path(__file__).resolve()
    other = [p for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py") if p.resolve() != here]
    other += [p for d in ("tools", "recipes") for p in (ROOT / d).rglob("*")
              if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return _sources() + sorted(other) + [ROOT / "README.md"]


def _lines(paths: list[Path] | None = None):
    for path in _cited_files() if paths is None else paths:
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{no}", line


def _headings(page: str) -> set[str]:
    text = (DOCS / f"{page}.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#+\s*§(\d+(?:\.\d+)?)\b", text, flags=re.M))


def _defined_rules() -> set[str]:
    found = set()
    for page in set(RULE_HOME.values()):
        found |= set(re.findall(r"\*\*([PV]\d{1,2})\*\*", (DOCS / f"{page}.md").read_text(encoding="utf-8")))
    return found


def _suggest(doc: str, sec: str | None) -> str:
    """The docs/ name for an old spec reference (serving.md §1–§5 moved to docs/parallelism.md)."""
    if doc == "chat-and-parsers":
        doc = "parsers"
    if doc == "serving" and sec is not None and int(sec) <= 5:
        doc = "parallelism"
    return f"docs/{doc}.md" + (f" §{sec}" if sec else "")


def test_cited_rules_are_defined_in_docs():
    defined = _defined_rules()
    missing = []
    for where, line in _lines():
        for kind, num in RULE.findall(line):
            rule = f"{kind}{num}"
            if rule not in defined:
                missing.append(f"{where}: {rule} is not defined in docs/{RULE_HOME[kind]}.md "
                               f"(add a '**{rule}**' entry there)")
    assert not missing, "rule ids cited but not described in docs/:\n" + "\n".join(missing)
    assert {f"P{i}" for i in range(1, 27)} | {f"V{i}" for i in range(1, 11)} <= defined


def test_cited_sections_exist_in_docs():
    missing = []
    count = 0
    for where, line in _lines():
        for page, first, tail in DOC_REF.findall(line):
            count += 1
            if not (DOCS / f"{page}.md").is_file():
                missing.append(f"{where}: docs/{page}.md does not exist")
                continue
            heads = _headings(page)
            for sec in [first, *re.findall(r"§\s*(\d+(?:\.\d+)?)", tail)]:
                if sec not in heads:
                    missing.append(f"{where}: docs/{page}.md has no section §{sec}")
    assert not missing, "sections cited but missing from docs/:\n" + "\n".join(missing)
    assert count > 100  # the collector sees the code's citations (about 150 of them)


def test_citations_name_docs_pages():
    stale = []
    for where, line in _lines():
        for m in BARE_REF.finditer(line):
            stale.append(f"{where}: '{m.group(0)}' -> cite {_suggest(m.group(1), m.group(3))}")
    assert not stale, "citations of pages outside docs/ (write the docs/ name):\n" + "\n".join(stale)


def test_no_issue_numbers_in_src():
    hits = [f"{w}: {line.strip()}" for w, line in _lines(_sources())
            if re.search(r"\bissues? ?#?\d+", line, re.I)]
    assert not hits, "src/ cites issue numbers (describe the behaviour in docs/ instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("line, expected", [
    ("see docs/serving.md §6–§7 and docs/parallelism.md §1, §3", [("serving", ["6", "7"]),
                                                                  ("parallelism", ["1", "3"])]),
    ("(docs/checkpoints.md §3.1-2)", [("checkpoints", ["3.1"])]),
])
def test_collector_reads_lists_and_ranges(line, expected):
    got = [(p, [f, *re.findall(r"§\s*(\d+(?:\.\d+)?)", t)]) for p, f, t in DOC_REF.findall(line)]
    assert got == expected


def test_collector_flags_old_spec_names():
    assert _suggest("serving", "3") == "docs/parallelism.md §3"
    assert [m.group(1) for m in BARE_REF.finditer("spec/serving.md §7, chat-and-parsers.md §3")] == [
        "serving", "chat-and-parsers"]
    assert not list(BARE_REF.finditer("docs/serving.md §7 docs/architecture.md README.md"))
