"""Server/LLM start-up runs the template/parser probe (issue 16 item 3): a mismatched
``--chat-template`` warns, and is refused under ``--strict-tool-format`` before any weight is read;
the checkpoint's own template prints nothing about it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from m2serve.serve.cli import build_parser, engine_args_from, resolve_options
from m2serve.serve.llm import LLM

M1_STYLE = str(Path(__file__).resolve().parents[1] / "text" / "m1_style_template.jinja")
SMALL = dict(dtype="float32", num_kv_pages=8, kv_cache_page_size=16, max_batch_input_tokens=64)


def test_strict_flag_reaches_llm_and_refuses(tiny_random_dir):
    parser = build_parser()
    opts = resolve_options(parser.parse_args(["serve", "--strict-tool-format"]), parser, environ={})
    assert engine_args_from(opts)["strict_tool_format"] is True
    with pytest.raises(ValueError, match="refused: --strict-tool-format"):
        LLM(str(tiny_random_dir), chat_template=M1_STYLE, strict_tool_format=True, **SMALL)


def _probe_records(caplog):
    return [r for r in caplog.records if r.name == "m2serve.text.tool_format"]


def test_mismatch_warns_and_own_template_is_silent(tiny_random_dir, caplog, capsys):
    with caplog.at_level(logging.DEBUG):
        LLM(str(tiny_random_dir), chat_template=M1_STYLE, **SMALL)
        assert [r.levelno for r in _probe_records(caplog)] == [logging.WARNING]
        caplog.clear()
        LLM(str(tiny_random_dir), strict_tool_format=True, **SMALL)
        LLM(str(tiny_random_dir), chat_template=M1_STYLE, tool_parser="none", **SMALL)
    assert _probe_records(caplog) == []
    assert not any("template" in r.getMessage() for r in caplog.records)
    assert "template" not in capsys.readouterr().err
