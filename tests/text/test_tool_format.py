"""Start-up probe of template vs tool parser (issue 16 item 3): the template's rendering of an
assistant tool call must be read back by the docs/parsers.md §3 parser. References: the
checkpoint's own template (writes §2's format: must pass), an M1-style template writing
``<tool_calls>`` JSON (§3 cannot read it), a template that drops tool calls."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from m2serve.text.template import ChatTemplate
from m2serve.text.tool_format import check_tool_format, probe_tool_format

HERE = Path(__file__).parent
M1_STYLE = ChatTemplate.from_file(HERE / "m1_style_template.jinja")
NO_CALLS = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def test_checkpoint_template_passes(tiny_random_dir, caplog):
    own = ChatTemplate.from_pretrained(tiny_random_dir)
    with caplog.at_level(logging.DEBUG):
        verdict = check_tool_format(own, "minimax_m2", strict=True)
    assert verdict.ok and "<minimax:tool_call>" in verdict.rendered
    assert caplog.records == []


def test_m1_style_template_is_a_mismatch(caplog):
    verdict = probe_tool_format(M1_STYLE)
    assert verdict.status == "mismatch"
    assert '<tool_calls>{"name": "m2serve_probe_weather"' in verdict.rendered
    with caplog.at_level(logging.WARNING):
        check_tool_format(M1_STYLE, "minimax_m2")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "m1_style_template.jinja and --tool-parser minimax_m2 disagree (mismatch)" in record.getMessage()
    assert "--strict-tool-format" in record.getMessage()
    with pytest.raises(ValueError, match=r"disagree \(mismatch\).*refused: --strict-tool-format"):
        check_tool_format(M1_STYLE, "minimax_m2", strict=True)


def test_template_without_tool_calls_warns(caplog):
    assert probe_tool_format(NO_CALLS).status == "no_tool_call"
    with caplog.at_level(logging.WARNING):
        check_tool_format(NO_CALLS, "minimax_m2")
    assert "disagree (no_tool_call)" in caplog.records[0].getMessage()


def test_template_raising_on_the_probe_warns(caplog):
    raising = ChatTemplate("{% if tools %}{{ raise_exception('no tools here') }}{% endif %}")
    verdict = probe_tool_format(raising)
    assert verdict.status == "render_error" and "no tools here" in verdict.detail


def test_skipped_without_tool_parser(caplog):
    with caplog.at_level(logging.DEBUG):
        assert check_tool_format(M1_STYLE, "none", strict=True) is None
    assert caplog.records == []
