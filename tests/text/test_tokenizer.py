"""Tokenizer and incremental detokeniser (docs/parsers.md §1) on the tiny-random checkpoint,
with transformers' tokenizer for the same files as the independent reference."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from m2serve.text.detokenizer import IncrementalDetokenizer
from m2serve.text.tokenizer import PARSER_TAGS, REQUIRED_TOKENS, Tokenizer

MIXED = ("天气怎么样？🌧️ Grüße, 東京 and こんにちは 👩\u200d💻🙂 — naïve café, 한국어, ελληνικά, "
         "emoji flags 🇫🇷 and math ∑∫ done.")


@pytest.fixture(scope="module")
def tok(tiny_random_dir):
    return Tokenizer.from_pretrained(tiny_random_dir)


@pytest.fixture(scope="module")
def hf(tiny_random_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_random_dir))


def test_special_tokens_resolved_by_text(tok, hf, tiny_random_dir):  # §1 table
    for text in REQUIRED_TOKENS:
        assert tok.special_ids[text] == hf.convert_tokens_to_ids(text)
    gen = json.loads((tiny_random_dir / "generation_config.json").read_text())
    assert tok.eos_token_id == hf.convert_tokens_to_ids("[e~[") == gen["eos_token_id"]
    assert tok.eos_token_id in tok.stop_token_ids
    assert tok.think_id == hf.convert_tokens_to_ids("<think>")
    assert tok.think_end_id == hf.convert_tokens_to_ids("</think>")
    assert tok.tool_call_id == hf.convert_tokens_to_ids("<minimax:tool_call>")
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("]~!b[", "[e~[", "]!d~[")


def test_encode_like_transformers_without_added_special_tokens(tok, hf):  # §1
    prompt = ("]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\n" + MIXED
              + "[e~[\n]~b]ai\n<think>\n")
    ids = tok.encode(prompt)
    assert ids == hf.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.special_ids["]~!b["], tok.special_ids["]~b]"]]  # single ids, nothing added
    assert ids[-2] == tok.think_id
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_decode_skips_specials_but_keeps_parser_tags(tok, hf):  # §1: the four tags reach the parser
    text = "a<think>b</think>c<minimax:tool_call>d</minimax:tool_call>e[e~[]~b]f"
    ids = tok.encode(text)
    assert tok.decode(ids) == "a<think>b</think>c<minimax:tool_call>d</minimax:tool_call>ef"
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text
    for tag in PARSER_TAGS:
        assert not tok.is_skipped(tok.special_ids[tag])
    assert tok.is_skipped(tok.eos_token_id)


def test_missing_special_token_is_named(tiny_random_dir, tmp_path):  # §1: a missing one is an error naming it
    d = tmp_path / "broken"
    d.mkdir()
    spec = json.loads((tiny_random_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</minimax:tool_call>"]
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"'</minimax:tool_call>'"):
        Tokenizer.from_pretrained(d)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    shutil.copyfile(tiny_random_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "generation_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_pretrained(d)


@pytest.mark.parametrize("text", ["{broken", "[1]", '{"model": 5}'])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, text):  # §1; adversarial checkpoint
    # the tokenizers library raises a bare Exception (a traceback from the CLI); ours names the file
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers JSON file"):
        Tokenizer.from_pretrained(tmp_path)


def _stream(tok, ids, per=1, **kw):
    det = IncrementalDetokenizer(tok, **kw)
    pieces = [det.push(ids[i:i + per]) for i in range(0, len(ids), per)]
    return pieces + [det.flush()], det


def test_detokenizer_cjk_emoji_token_by_token(tok, hf):  # §1: no broken UTF-8, concat == full decode
    ids = tok.encode(MIXED * 3)
    assert any("\ufffd" in hf.decode([i]) for i in ids)  # the text really splits characters across tokens
    for per in (1, 2, 3):
        pieces, _ = _stream(tok, ids, per)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == hf.decode(ids) == MIXED * 3


def test_token_bytes_rebuild_split_characters(tok, hf):  # OpenAI logprob bytes: raw token bytes
    ids = tok.encode(MIXED * 3)
    assert any("\ufffd" in hf.decode([i]) for i in ids)  # some tokens hold part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == (MIXED * 3).encode("utf-8")
    assert tok.token_bytes(tok.think_id) == b"<think>"
    assert tok.token_bytes(tok.vocab_size + 5) == b""  # embedding padding past the tokenizer


def test_detokenizer_parser_tags_and_specials(tok):  # §1: tags stay text, other specials are skipped
    text = "<think>\n思考 🙂\n</think>\n\n答<minimax:tool_call>x</minimax:tool_call>[e~[]~b]ai"
    ids = tok.encode(text)
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text.replace("[e~[]~b]", "")
    assert "<think>" in pieces and "</minimax:tool_call>" in pieces  # whole tags arrive as one piece
    kept, _ = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(kept) == text


def test_detokenizer_random_bytes_concat_equals_decode(tok):  # §1 on arbitrary (even invalid) ids
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)


def test_detokenizer_holds_back_stop_strings(tok):  # §1 stop strings: never emit a possible match
    text = "Hello 世界. STOP here"
    ids = tok.encode(text)
    pieces, det = _stream(tok, ids, stop=["STOP"])
    out = "".join(pieces)
    assert out == "Hello 世界. " and det.stopped
    seen = ""
    det = IncrementalDetokenizer(tok, stop=["世界!"])
    for i in ids:
        seen += det.push([i])
        assert not seen.endswith(("世", "世界"))  # a possible stop prefix is never out early
    assert seen + det.flush() == text
