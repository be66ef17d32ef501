"""The committed `tiny-chat` checkpoint (issue 6): format, tokenizer, held-out split, accuracy floors and
transformers-vs-m2serve greedy equality.

References: docs/checkpoints.md §1/§4/§7 (files, FP8 block format, dtypes), docs/parsers.md §1
(special tokens) and §2 (template); the expected answers come from the data generator
(tools/tiny_chat/data.py) and the oracle is transformers' MiniMaxM2ForCausalLM (docs/model.md §6).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.tiny_chat import data, export  # noqa: E402
from tools.tiny_chat import evaluate as ev  # noqa: E402

CKPT = REPO / "src/m2serve/checkpoints/tiny-chat"
# The release's quantization_config (docs/checkpoints.md §4), verbatim.
RELEASE_FP8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128],
               "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
# The fixed subset of the floors test: the first N held-out examples of each kind (issue 6's 50, plus
# 15 tool results in natural shapes, issue 15 item 4).
FLOOR_SUBSET = {"tool_call": 20, "tool_result": 15, "no_tool": 15, "natural_result": 15}


def _subset() -> list[data.Example]:
    return [ex for kind, n in FLOOR_SUBSET.items() for ex in data.eval_subset(kind, n)]


def test_files_size_and_configs():
    # docs/checkpoints.md §1 files; issue 6: <= 25 MB in total; docs/model.md §1 generation defaults
    names = {p.name for p in CKPT.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= names
    assert sum(p.stat().st_size for p in CKPT.iterdir()) <= 25 * 10**6
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["quantization_config"] == RELEASE_FP8
    dims = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                "rotary_dim", "intermediate_size", "num_local_experts",
                                "num_experts_per_tok", "num_hidden_layers")}
    assert dims == {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                    "rotary_dim": 64, "intermediate_size": 512, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "num_hidden_layers": 4}
    assert cfg["vocab_size"] % 128 == 0
    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    gen = json.loads((CKPT / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.token_to_id("]~b]"), tok.token_to_id("[e~["))
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (1.0, 0.95, 40)
    # docs/parsers.md §2: the checkpoint carries the repository's one template (tests/test_one_home.py)
    assert (CKPT / "chat_template.jinja").is_file()


def test_tensor_dtypes_follow_the_fp8_release():
    # docs/checkpoints.md §2/§7: q/k/v/o and experts F8_E4M3 + fp32 weight_scale_inv [N/128, K/128];
    # router gate and bias fp32; embed, lm_head and norms bf16
    with safe_open(str(CKPT / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for n in names:
            t = f.get_slice(n)
            dtype = t.get_dtype()
            if n.endswith("weight_scale_inv"):
                w = f.get_slice(n[: -len("_scale_inv")]).get_shape()
                assert dtype == "F32" and t.get_shape() == [w[0] // 128, w[1] // 128], n
            elif ("self_attn." in n and n.endswith("_proj.weight")) or ".experts." in n:
                assert dtype == "F8_E4M3", n
            elif n.endswith(("gate.weight", "e_score_correction_bias")):
                assert dtype == "F32", n
            else:
                assert dtype == "BF16", n
    assert len([n for n in names if ".experts." in n and n.endswith(".weight")]) == 4 * 8 * 3
    with safe_open(str(CKPT / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.0.block_sparse_moe.e_score_correction_bias")
    assert bias.abs().max() > 0  # trained load-balancing bias, not the zero init


def test_tokenizer_special_tokens_and_transformers_agreement():
    # docs/parsers.md §1: each special token one id; no added specials when encoding a prompt
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    for s in ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>",
              "]!p~[", "]!d~["):
        assert len(tok.encode(s, add_special_tokens=False).ids) == 1, s
    ex = data.eval_subset("tool_result", 1)[0]
    prompt = data.render(data.load_template(CKPT / "chat_template.jinja"), ex.prompt_messages, ex.tools, True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    hf = AutoTokenizer.from_pretrained(str(CKPT))
    assert hf.encode(prompt, add_special_tokens=False) == ids
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def _strings(x) -> list[str]:
    """String leaves of an argument structure."""
    if isinstance(x, dict):
        return [v for y in x.values() for v in _strings(y)]
    if isinstance(x, list):
        return [v for y in x for v in _strings(y)]
    return [x] if isinstance(x, str) else []


def test_held_out_values_never_occur_in_training():
    # issue 6: the eval split's argument values never occur in training. Checked on every call's
    # whole argument object, every string argument (enums excepted: a finite shared set) and every
    # tool result value.
    enums = {v for t in data.TOOLS for p in t.properties.values() for v in p.get("enum", ())}
    seen: dict[str, tuple[set, set]] = {}
    for split in ("train", "eval"):
        whole, leaves = set(), set()
        for ex in data.make_examples(split, 3000, seed=0):
            for m in ex.messages:
                for c in m.get("tool_calls") or ():
                    args = c["function"]["arguments"]
                    whole.add(json.dumps([c["function"]["name"], args], sort_keys=True))
                    leaves.update(v for v in _strings(args) if v not in enums)
            leaves.update(ex.result_values)
        seen[split] = (whole, leaves)
    (train_whole, train_leaves), (eval_whole, eval_leaves) = seen["train"], seen["eval"]
    assert len(eval_whole) > 500 and len(eval_leaves) > 500
    assert not eval_whole & train_whole
    assert not eval_leaves & train_leaves


def test_export_inverts_to_the_training_weights_bit_for_bit():
    # tools/tiny_chat/export.py train_state: fine-tuning starts from the committed FP8 checkpoint; its
    # dequantised weights re-export (quantize_fp8_block, bf16 casts) to the same bytes, so the loader is
    # the exact inverse of hub_tensors on this checkpoint (docs/checkpoints.md §6/§8)
    from safetensors.torch import load_file

    state, dims = export.train_state(CKPT)
    assert all(t.dtype == torch.float32 for t in state.values())
    again = export.hub_tensors(state, dims["num_hidden_layers"])
    stored = load_file(str(CKPT / "model.safetensors"))
    assert again.keys() == stored.keys()
    for name, t in stored.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name].view(torch.uint8),
                                                            t.view(torch.uint8)), name


def test_natural_results_answer_with_every_value_and_carry_it_in_the_tool_message():
    # tools/tiny_chat/data.py natural_result: each value the answer must contain is a leaf of the tool
    # message (JSON, compact JSON, Python str() or the plain string), and the answer contains it
    examples = data.eval_subset("natural_result", 200)
    shapes = set()
    for ex in examples:
        tool_text = " ".join(m["content"] for m in ex.messages if m["role"] == "tool")
        answer = ex.messages[-1]["content"]
        assert ex.result_values and all(v in tool_text and v in answer for v in ex.result_values), ex.messages
        for m in ex.messages:
            if m["role"] == "tool":
                c = m["content"]
                structured = c[:1] in "{["
                shapes.add("json" if structured and '"' in c[:3] else "python" if structured else "text")
    assert shapes == {"json", "python", "text"}


def test_result_drills_take_the_loss_on_the_restated_latest_response():
    # tools/tiny_chat/data.py result_drill / train.py result_batch: the loss covers exactly the answer's
    # restatement of the last <response> (the distractors, its twins among them, come before it)
    from tools.tiny_chat import train

    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    rng = random.Random(0)
    for twins in (True, False):
        for _ in range(100):
            text, start, content = data.result_drill(rng, twins=twins)
            assert text[start:] == content + "."
            last = re.fullmatch(r"(?s).*<response>(.*)</response>\nResult of (\w+): ", text[:start])
            assert last and last[1] == content and last[2] in data.TOOLS_BY_NAME
    _, _, labels = train.result_batch(tok, 8, seed=5, step=3)
    rng = random.Random("result:5:3")
    for lab in labels:
        _, _, content = data.result_drill(rng)
        assert tok.decode(lab[lab != -100].tolist(), skip_special_tokens=False) == content + "."


def test_bare_call_turns_take_no_loss_and_leave_other_corpora_unchanged():
    # tools/tiny_chat/data.py make_example bare_calls: a call turn sent back without reasoning (as API
    # clients do) is context, not a target (train.py encode_example), so the model keeps reasoning
    # before a call; at 0 the corpus is the one the documented earlier runs drew
    from tools.tiny_chat import train

    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    tpl = data.load_template()
    assert data.make_examples("train", 40, 3) == data.make_examples("train", 40, 3, bare_calls=0.0)
    bare = [ex for ex in data.make_examples("train", 60, 3, bare_calls=1.0)
            if ex.kind in ("tool_result", "natural_result")]
    assert bare and all("reasoning_content" not in ex.messages[1] for ex in bare)
    for ex in bare[:5]:
        ids, mask = train.encode_example(tok, tpl, ex)
        target = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert "<minimax:tool_call>" not in target and ex.messages[-1]["content"] in target


@pytest.fixture(scope="module")
def m2serve_outputs():
    return ev.generate_m2serve(CKPT, _subset(), dtype="float32", kv_cache_format="float32")


@pytest.mark.slow  # generates the fixed evaluation subset
def test_accuracy_floors_on_fixed_subset(m2serve_outputs):
    # issue 6 "must show": floors 80% / 80% / 80% on a fixed 50-example held-out subset, greedy through
    # the m2serve engine and parser; for no_tool, a call the parser rejects (to a tool that was not
    # offered) counts as a call (evaluate.made_call). Issue 15 item 4: answers after natural-shape
    # tool results (objects, nested values, lists, plain strings) contain every value, same floor
    r = ev.rates(_subset(), m2serve_outputs)
    for kind in ("tool_call", "tool_result", "no_tool", "natural_result"):
        ok, n = r[kind]
        assert ok >= 0.8 * n, f"{kind}: {ok}/{n} below the 80% floor"


def test_a_rejected_call_still_counts_as_a_call():
    # the eval once scored no_tool by parsed calls only: a call to a tool that was not offered is
    # rejected by the parser and left in the text, so it counted as "no call" (the rate read 100% while
    # about half the requests called the absent tool)
    ex = data.eval_subset("no_tool", 1)[0]
    block = '<minimax:tool_call>\n<invoke name="absent_tool">\n</invoke>\n</minimax:tool_call>'
    called = ev.Generation([], "r\n</think>\n\n" + block, "r", block, [], "stop")
    answered = ev.Generation([], "r\n</think>\n\nSorry, I cannot.", "r", "Sorry, I cannot.", [], "stop")
    assert not ev.score(ex, called) and ev.score(ex, answered)


@pytest.mark.slow  # the evaluation subset's outputs (fixture above)
def test_reasoning_always_closed(m2serve_outputs):
    # issue 6 "must show": reasoning always closed before content or a call (the generation prompt
    # opens <think>, docs/parsers.md §2)
    ok, n = ev.rates(_subset(), m2serve_outputs)["reasoning_closed"]
    assert ok == n, f"reasoning not closed in {n - ok}/{n} outputs"


@pytest.mark.slow  # greedy decoding in both engines
def test_transformers_and_m2serve_same_greedy_tokens():
    # issue 6 / docs/model.md §6: transformers (fp32, FP8 dequantised at load) and m2serve load the
    # committed FP8 checkpoint and give the same greedy tokens on 20 held-out prompts
    examples = [ex for kind in ("tool_call", "tool_result", "no_tool", "plain")
                for ex in data.eval_subset(kind, 5, seed=99)]
    ours = ev.generate_m2serve(CKPT, examples, max_tokens=48, dtype="float32", kv_cache_format="float32")
    ref = ev.generate_transformers(CKPT, examples, max_tokens=48, batch_size=1)  # unpadded, as served
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.token_ids == b.token_ids, f"prompt {i}: {a.text!r} != {b.text!r}"
    assert torch.tensor([len(a.token_ids) for a in ours]).min() > 4


def test_is_the_embedded_default():
    # issue 6: tiny-chat is the embedded default of `m2serve serve` / `m2serve generate` (no --model)
    from m2serve.serve.resolve import resolve_config, resolve_model

    assert resolve_model(None) == CKPT.resolve()
    assert resolve_config(None) == CKPT.resolve() / "config.json"


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i: i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_values_tokenise_the_same_in_request_and_call():
    # tools/tiny_chat/tokenizer.py "Split rule": every string argument value has the same token ids in
    # the user's request and inside <parameter ...>value</parameter> (copying = token-identity copying)
    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    tpl = data.load_template(CKPT / "chat_template.jinja")
    checked = 0
    for ex in data.eval_subset("tool_call", 40):
        user = tok.encode(ex.messages[0]["content"], add_special_tokens=False).ids
        full = data.render(tpl, ex.messages, ex.tools, add_generation_prompt=False)
        call = tok.encode(full[full.rindex("<minimax:tool_call>"):], add_special_tokens=False).ids
        for _, args in ex.calls:
            for v in _strings(args):
                if v not in ex.messages[0]["content"]:
                    continue  # an enum value the request names differently
                ids = tok.encode(v, add_special_tokens=False).ids
                assert _contains(user, ids) and _contains(call, ids), v
                checked += 1
    assert checked >= 40


def test_verdict_token_is_copyable_exactly_when_the_tool_is_offered():
    # tools/tiny_chat/data.py verdict_reasoning: after 'I need "NAME' the next token is '", ' (offered) or
    # '". ' (not offered). The offered verdict must be copyable from the prompt: the tokens '"NAME", '
    # occur in the rendered tool list when the tool is offered and nowhere in the prompt when it is not.
    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    tpl = data.load_template(CKPT / "chat_template.jinja")
    s = data.Sampler(random.Random(5), "eval")
    for _ in range(60):
        offered, absent, name = data.verdict_prompt(s, tpl)
        quoted = tok.encode(f'"{name}", x', add_special_tokens=False).ids[:-1]
        head = "The user wants "
        for text, want in ((offered, True), (absent, False)):
            prompt = tok.encode(text[: text.rindex(head)], add_special_tokens=False).ids
            assert _contains(prompt, quoted) == want, (name, want)
        for text, verdict in ((offered, True), (absent, False)):
            reasoning = data.verdict_reasoning("x", [name], verdict)
            rest = reasoning[reasoning.index(name) + len(name):]  # '", which is ...' / '". It is not ...'
            before = tok.encode(text, add_special_tokens=False).ids
            full = tok.encode(text + rest, add_special_tokens=False)
            assert full.ids[: len(before)] == before
            assert full.tokens[len(before)] == ('",Ġ' if verdict else '".Ġ'), (name, verdict)
