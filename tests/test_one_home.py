"""One home for every rule: each is defined once and imported, so copies cannot drift.

Per rule, a grep over the code of src/m2serve (comments and strings removed with ``tokenize``, so
docstrings may still quote the numbers) finds no second definition, plus a behavioural check
where one is cheap.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from m2serve.checkpoints import CHAT_TEMPLATE, TINY_CHAT
from m2serve.checkpoints.tokenizer_train import train_tokenizer
from m2serve.config.engine_args import COMPUTE_DTYPES, KV_CACHE_FORMATS
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP, REFUSED_QUANT_METHODS
from m2serve.formats.detect import detect_quant
from m2serve.serve.cli import build_parser
from m2serve.text.template import RESERVED_TEMPLATE_VARIABLES, ChatTemplate, TemplateError
from m2serve.text.tokenizer import ADDED_TOKENS, CONTROL_TOKENS, PARSER_TAGS

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "m2serve"


def _code(path: Path) -> str:
    """The file's code with comments and string literals blanked (names, numbers, operators kept)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", None):
            out.append('""')
        elif tok.type != tokenize.COMMENT:
            out.append(tok.string)
    return " ".join(out)


def _raw(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _hits(pattern: str, *, code_only: bool, roots=(SRC,)) -> list[str]:
    rx = re.compile(pattern)
    found = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            text = _code(p) if code_only else _raw(p)
            if rx.search(text):
                found.append(str(p.relative_to(ROOT)))
    return found


# --- refused quantisation methods ---------------------------------------------------------------

def test_refused_quant_methods_have_one_home():
    assert _hits(r'"gptq"\s*:', code_only=False) == ["src/m2serve/config/quant.py"]


@pytest.mark.parametrize("method", sorted(REFUSED_QUANT_METHODS))
def test_config_and_detection_refuse_the_same_methods(method):
    name = REFUSED_QUANT_METHODS[method]
    cfg = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 256,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
           "intermediate_size": 256, "vocab_size": 512, "quantization_config": {"quant_method": method}}
    refused = f"^{re.escape(name)} MiniMax-M2 checkpoints are not supported"
    with pytest.raises(NotImplementedError, match=refused):
        MiniMaxM2Config.from_dict(cfg)
    with pytest.raises(NotImplementedError, match=refused):
        detect_quant({"quant_method": method})


# --- reserved template variables ----------------------------------------------------------------

def test_reserved_template_variables_have_one_home():
    # a literal list of the reserved names ("messages", "tools", ...) exists only in text/template.py
    assert _hits(r'"messages"\s*,\s*"tools"', code_only=False) == ["src/m2serve/text/template.py"]


_RENDER_PARAMS = set(inspect.signature(ChatTemplate.render).parameters)


@pytest.mark.parametrize("name", [n for n in RESERVED_TEMPLATE_VARIABLES if n not in _RENDER_PARAMS])
def test_reserved_token_variables_are_refused(name):
    # messages / tools / add_generation_prompt are render's own parameters; the rest are refused here
    assert {"messages", "tools", "add_generation_prompt"} <= _RENDER_PARAMS & set(RESERVED_TEMPLATE_VARIABLES)
    tpl = ChatTemplate("{{ messages[0].content }}")
    with pytest.raises(TemplateError, match=f"chat_template_kwargs may not set {name}"):
        tpl.render([{"role": "user", "content": "hi"}], **{name: "x"})


# --- which added tokens are special -------------------------------------------------------------

def test_added_tokens_are_declared_once():
    roots = (SRC, ROOT / "tools")
    assert _hits(r"\bAddedToken\s*\(", code_only=True, roots=roots) == ["src/m2serve/text/tokenizer.py"]


def _special_flags(tokenizer_json: dict) -> dict[str, bool]:
    return {t["content"]: t["special"] for t in tokenizer_json["added_tokens"]}


def test_both_embedded_tokenizers_follow_the_one_special_rule():
    want = {t: t in CONTROL_TOKENS for t in ADDED_TOKENS}
    assert not any(want[t] for t in PARSER_TAGS) and all(want[t] for t in CONTROL_TOKENS)
    tiny_random = json.loads(train_tokenizer().to_str())
    tiny_chat = json.loads((TINY_CHAT / "tokenizer.json").read_text())
    assert _special_flags(tiny_random) == want
    assert _special_flags(tiny_chat) == want
    # same order (the release's): ids are consecutive after the BPE vocabulary
    for tok in (tiny_random, tiny_chat):
        ids = [t["id"] for t in tok["added_tokens"]]
        assert [t["content"] for t in tok["added_tokens"]] == list(ADDED_TOKENS)
        assert ids == list(range(ids[0], ids[0] + len(ids)))


def test_tiny_random_tokenizer_config_agrees(tiny_random_dir):
    tc = json.loads((tiny_random_dir / "tokenizer_config.json").read_text())
    assert {v["content"]: v["special"] for v in tc["added_tokens_decoder"].values()} == \
        {t: t in CONTROL_TOKENS for t in ADDED_TOKENS}


# --- FP8 block size and FP4 group sizes ---------------------------------------------------------

def test_block_and_group_sizes_have_one_home():
    # no code computes with a literal 128 / 16 / 32 block or group (// or %), nor writes [128, 128]
    assert _hits(r"(//|%)\s*(128|16|32)\b|\[\s*128\s*,\s*128\s*\]", code_only=True) == []
    assert _hits(r"(?m)^\s*_?[A-Z0-9_]*(BLOCK|GROUP)\s*=\s*(16|32|128)\b", code_only=False) == [
        "src/m2serve/config/quant.py"]
    assert (FP8_BLOCK, NVFP4_GROUP, MXFP4_GROUP) == (128, 16, 32)                    # docs/checkpoints.md §4
    quant = (SRC / "config" / "quant.py").read_text()
    assert re.search(r"^FP8_BLOCK = 128$", quant, re.M)


# --- dtype-name tables --------------------------------------------------------------------------

def test_dtype_name_tables_have_one_home():
    assert _hits(r'\{\s*"bfloat16"\s*:', code_only=False) == ["src/m2serve/config/engine_args.py"]
    assert _hits(r'"float32"\s*:\s*torch\.float32', code_only=False) == []


def test_cli_choices_are_the_tables():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    choices = {a.dest: a.choices for a in serve._actions if a.choices}
    assert choices["dtype"] == list(COMPUTE_DTYPES)
    assert choices["kv_cache_format"] == list(KV_CACHE_FORMATS)


# --- the chat template --------------------------------------------------------------------------

def test_one_chat_template_file():
    tracked = subprocess.run(["git", "ls-files", "*chat_template.jinja"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked == ["src/m2serve/checkpoints/tiny-chat/chat_template.jinja"]
    assert CHAT_TEMPLATE.resolve() == (TINY_CHAT / "chat_template.jinja").resolve()


def test_prompt_length_rule_has_one_home():
    # prompt + 1 <= max_length is decided by engine/request.py prompt_length_error, which the engine
    # and the chat pipeline both call; nobody compares a prompt length with max_length themselves
    assert _hits(r"len\(ids\)\s*(>=|>)\s*(self\.max_length|ctx\.caps\.max_length)", code_only=True) == []
    assert sorted(_hits(r"prompt_length_error\(", code_only=False)) == [
        "src/m2serve/engine/core.py", "src/m2serve/engine/request.py", "src/m2serve/serve/chat_pipeline.py"]
