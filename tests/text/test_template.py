"""Chat-template rendering (docs/parsers.md §2): the acceptance cases of
tests/data/template_cases.jsonl, parity with transformers' own renderer (the oracle for the
sandbox environment), message normalisation, errors naming the message index, and the sandbox."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from m2serve.text.template import ChatTemplate, TemplateError, normalize_messages

CASE_FILE = Path(__file__).resolve().parents[1] / "data" / "template_cases.jsonl"
CASES = [json.loads(line) for line in CASE_FILE.read_text(encoding="utf-8").splitlines() if line]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def template(tiny_random_dir):
    return ChatTemplate.from_pretrained(tiny_random_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_random_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_random_dir))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_template_case(case, template):  # spec §2, acceptance cases
    out = template.render(case["messages"], case["tools"], case["add_generation_prompt"])
    assert out.startswith("]~!b[")
    for s in case["expect_contains"]:
        assert s in out
    for s in case["expect_not_contains"]:
        assert s not in out
    if case["expect_endswith"] is not None:
        assert out.endswith(case["expect_endswith"])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_same_as_transformers(case, template, hf_tokenizer):  # spec §2 rendering rule
    messages = normalize_messages(case["messages"])
    want = hf_tokenizer.apply_chat_template(messages, tools=case["tools"], tokenize=False,
                                            add_generation_prompt=case["add_generation_prompt"])
    assert template.render(case["messages"], case["tools"], case["add_generation_prompt"]) == want


def test_string_arguments_parsed(template):  # §2 normalisation: arguments as JSON string or object
    def conv(args):
        return [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": args}}]}]
    as_text = template.render(conv('{"x": 1, "s": "a b"}'), TOOLS)
    assert as_text == template.render(conv({"x": 1, "s": "a b"}), TOOLS)
    assert '<parameter name="x">1</parameter>\n<parameter name="s">a b</parameter>' in as_text
    assert "None" not in as_text  # content null renders as nothing
    with pytest.raises(TemplateError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments") as err:
        template.render(conv("{not json"), TOOLS)
    assert err.value.message_index == 1
    with pytest.raises(TemplateError, match="must be a JSON object"):
        template.render(conv("[1, 2]"), TOOLS)


def test_top_level_name_and_arguments_copies():  # §2: official template reads tool_calls[-1].name
    official_style = ("{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[-1].name }}:"
                      "{% for k, v in m.tool_calls[0].arguments.items() %}{{ k }}={{ v }}{% endfor %}"
                      "{% endif %}{% endfor %}")
    call = {"type": "function", "function": {"name": "g", "arguments": '{"a": 2}'}}
    msgs = [{"role": "assistant", "tool_calls": [call]}]
    assert ChatTemplate(official_style).render(msgs) == "g:a=2"
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 2}'  # the caller's dicts are untouched


def test_reasoning_aliases_and_inline_think(template):  # §2 normalisation
    base = [{"role": "user", "content": "q"}]
    want = template.render(base + [{"role": "assistant", "content": "A", "reasoning_content": "R"}],
                           add_generation_prompt=False)
    assert "<think>\nR\n</think>\n\nA[e~[" in want
    for alias in ("reasoning", "thinking"):
        assert template.render(base + [{"role": "assistant", "content": "A", alias: "R"}],
                               add_generation_prompt=False) == want
    echoed = {"role": "assistant", "content": "<think>R</think>\n\nA", "reasoning_content": "R"}
    assert template.render(base + [echoed], add_generation_prompt=False) == want
    inline_only = {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}  # the template splits it
    assert template.render(base + [inline_only], add_generation_prompt=False) == want


def test_text_parts_joined_and_other_parts_rejected(template):  # §2: text-only model
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert "]~b]user\nHello there[e~[" in template.render([{"role": "user", "content": parts}])
    bad = [{"role": "user", "content": "a"},
           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(TemplateError, match=r"messages\[1\]\.content\[0\].*image_url.*text parts only"):
        template.render(bad)


@pytest.mark.parametrize("text", [5, None, ["x"]])
def test_text_part_with_non_string_text_says_so(template, text):  # §2; adversarial request
    # a text part whose "text" is not a string is named as such, not as an unsupported part type
    bad = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    with pytest.raises(TemplateError, match=r"messages\[0\]\.content\[0\]\.text must be a string, got"):
        template.render(bad)


def test_raise_exception_names_message_index(template):  # §2: tool message without a tool call
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "tool", "content": "r"}]
    with pytest.raises(TemplateError, match=r"messages\[2\].*tool") as err:
        template.render(msgs)
    assert err.value.message_index == 2


def test_sandbox_denies_python_internals():  # §2: sandboxed environment
    with pytest.raises(TemplateError, match="sandbox|unsafe|not safely callable|attribute"):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


def test_environment_features():  # §2: tojson, strftime_now, namespace, loopcontrols, kwargs, tokens
    src = ("{{ {'k': 'é', 'n': [1, 2]} | tojson }}|{{ strftime_now('%Y') }}|"
           "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}"
           "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ flavour }}|{{ bos_token }}\n"
           "  {% if true %}\n  x\n{% endif %}")  # trim_blocks + lstrip_blocks
    out = ChatTemplate(src, bos_token="]~!b[").render([], flavour="mint")
    assert out == f'{{"k": "é", "n": [1, 2]}}|{datetime.now().year}|3|mint|]~!b[\n  x\n'
    with pytest.raises(TemplateError, match="bos_token"):
        ChatTemplate(src).render([], bos_token="x")


def test_tokenizer_config_fallback_and_missing(tiny_random_dir, tmp_path):  # §2: where the template lives
    d = tmp_path / "ckpt"
    d.mkdir()
    config = json.loads((Path(tiny_random_dir) / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{{ messages[0].content }}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_pretrained(d).render([{"role": "user", "content": "hi"}]) == "]~!b[hi"
    shutil.copyfile(Path(tiny_random_dir) / "chat_template.jinja", d / "chat_template.jinja")
    rendered = ChatTemplate.from_pretrained(d).render([{"role": "user", "content": "hi"}])
    assert rendered.endswith("]~b]ai\n<think>\n")  # chat_template.jinja wins over tokenizer_config.json
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="chat_template.jinja.*tokenizer_config.json"):
        ChatTemplate.from_pretrained(empty)
    (empty / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="chat_template.jinja: chat template syntax error"):
        ChatTemplate.from_pretrained(empty)


def test_bad_messages_named():
    with pytest.raises(TemplateError, match=r"messages\[0\]\.role"):
        normalize_messages([{"content": "x"}])
    with pytest.raises(TemplateError, match=r"messages\[1\] must be an object"):
        normalize_messages([{"role": "user", "content": "x"}, "hi"])


def test_failing_message_found_in_log_renders(template, monkeypatch):
    # adversarial: the error path re-rendered every prefix (quadratic: 3,000 messages took 32 s on the
    # event loop); a binary search over prefix lengths names the same first failing message
    tpl = template
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(1024)]
    msgs[700] = {"role": "narrator", "content": "x"}
    renders = []
    real = ChatTemplate._render
    monkeypatch.setattr(ChatTemplate, "_render", lambda self, *a: renders.append(1) or real(self, *a))
    with pytest.raises(TemplateError, match=r"^messages\[700\]: .*narrator"):
        tpl.render(msgs)
    assert len(renders) <= 2 + 11  # the failed render, the whole history, then log2(1024) + 1 prefixes


# official_style_template.jinja reproduces the content handling of the released MiniMax-M2
# chat_template.jinja (its macro and branches, other parts left out): ``visible_text``
# falls through to ``{{ content }}`` for anything neither string nor list (so a None would print
# "None"), assistant content goes through it, a tool message's list content renders one
# ``<response>`` per item and its string content one ``<response>``; tool_calls[-1].name is read.
OFFICIAL_STYLE = (Path(__file__).parent / "official_style_template.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("null_content", [{"content": None}, {}], ids=["null", "missing"])
def test_official_template_content_handling(null_content):  # issue 16 item 1, spec §2 normalisation
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [call], **null_content},
            {"role": "tool", "tool_call_id": "c1",
             "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
            {"role": "assistant", "content": "ok"}]
    tpl = ChatTemplate(OFFICIAL_STYLE)
    assert tpl.iterates_content
    out = tpl.render(msgs, add_generation_prompt=False)
    # hand-derived from the template text: no "None", one <response> per list item
    assert out == ("]~b]user\nq[e~[\n"
                   ']~b]ai\n\n<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">1</parameter>\n'
                   "</invoke>\n</minimax:tool_call>[e~[\n"
                   "]~b]tool\n<response>r1\n</response>\n<response>r2\n</response>[e~[\n"
                   "]~b]ai\nok[e~[\n")
    msgs[2]["content"] = "r"  # string content: the template's string branch
    assert "]~b]tool\n<response>r</response>[e~[\n" in tpl.render(msgs, add_generation_prompt=False)


def test_content_lists_joined_for_string_templates(template):  # issue 16 item 1
    assert not template.iterates_content  # the embedded template reads content as a string
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "]~b]tool\n<response>ab</response>[e~[\n" in template.render(msgs)
    assert normalize_messages([{"role": "assistant"}]) == [{"role": "assistant", "content": ""}]
    with pytest.raises(TemplateError, match=r"messages\[0\]\.content\[0\].*image_url"):
        ChatTemplate(OFFICIAL_STYLE).render([{"role": "tool", "content": [{"type": "image_url"}]}])


@pytest.mark.parametrize("final", [
    {"role": "assistant", "content": "The weather in"},
    {"role": "assistant", "content": "Paris"},   # also earlier in the conversation: the last one is cut
    {"role": "assistant", "content": "  Paris is  "},   # the template strips it: the prompt keeps its text
    {"role": "assistant", "content": "Paris", "reasoning_content": "Say the city."},
    {"role": "assistant", "content": [{"type": "text", "text": "Par"}, {"type": "text", "text": "is"}]},
])
def test_continue_final_message_as_transformers_does(template, hf_tokenizer, final):
    """vLLM's ``continue_final_message`` (and Anthropic's prefilled assistant turn): the prompt ends right
    after the last assistant message's content, no end of turn, no generation prompt. The oracle is
    transformers' own ``apply_chat_template(continue_final_message=True)``."""
    msgs = [{"role": "user", "content": "Paris?"}, final]
    want = hf_tokenizer.apply_chat_template(normalize_messages(msgs), tokenize=False,
                                            continue_final_message=True)
    assert template.render(msgs, continue_final_message=True) == want
    assert template.render(msgs, add_generation_prompt=True, continue_final_message=True) == want


def test_continue_final_message_with_empty_content_opens_the_turn(template):
    # an empty content: the marker places it right after the assistant header, newline included
    # (hand-derived from the template text; transformers' search for "" cuts before that newline)
    out = template.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
                          continue_final_message=True)
    assert out.endswith("]~b]user\nq[e~[\n]~b]ai\n")


@pytest.mark.parametrize("msgs, message", [
    ([{"role": "user", "content": "q"}], "messages[0]: only an assistant message can be continued"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[1]: an assistant message to be continued holds text only"),
])
def test_what_cannot_be_continued_is_named(template, msgs, message):
    with pytest.raises(TemplateError, match=re.escape(message)):
        template.render(msgs, TOOLS, continue_final_message=True)


def test_a_template_that_rewrites_the_content_cannot_be_continued():
    # the content is written upper-cased: no place in the prompt holds it as given
    tpl = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</{{ m.role }}>"
                       "{% endfor %}")
    with pytest.raises(TemplateError, match="does not write this assistant message's content"):
        tpl.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                   continue_final_message=True)
