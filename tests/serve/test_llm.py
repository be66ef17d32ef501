"""The offline ``LLM`` API and its output processor (issue 4 item 6; docs/parsers.md §1, §3).

Real tiny-random engine. References are independent of the code under test: the token ids the engine
produced (decoded by the tokenizer), an unstopped run for stop strings, and the text layer's
non-streaming ``parse_output`` for chat.
"""

from __future__ import annotations

import pytest

from m2serve.engine.sampling import SamplingParams
from m2serve.serve.llm import LLM
from m2serve.text.parser import parse_output

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_random_dir):
    return LLM(
        str(tiny_random_dir),
        dtype="float32",
        num_kv_pages=256,
        kv_cache_page_size=16,
        max_batch_input_tokens=256,
    )


def test_generate_text_is_decode_of_ids(llm):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    results = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert [r.prompt for r in results] == prompts
    for prompt, r in zip(prompts, results):
        o = r.outputs[0]
        assert r.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert len(o.token_ids) == 12 and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)
    # token-id prompts give the same greedy output
    again = llm.generate([results[0].prompt_token_ids], SamplingParams(max_tokens=12, **GREEDY))
    assert again[0].outputs[0].token_ids == results[0].outputs[0].token_ids


def test_generate_takes_structured_outputs_as_completions_does(llm):
    # random weights, sampled: only the constraint can make every completion match (Python's re is the
    # independent check); a bad pattern raises the server's 400 message, naming the field
    import re

    pattern = r"[a-z]{2,5}-[0-9]{2}"
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(4)]
    results = llm.generate(["The code is"] * 4, params, structured_outputs={"regex": pattern})
    for r in results:
        assert re.fullmatch(pattern, r.outputs[0].text), r.outputs[0].text
        assert r.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex"):
        llm.generate(["x"], structured_outputs={"regex": "(unclosed"})


def test_stop_string_split_across_tokens_is_never_emitted(llm):
    # spec §1 + issue 4 "stop strings never appear in output": pick a stop string that straddles two tokens
    prompt = "Once upon a time"
    [free] = llm.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))
    ids = free.outputs[0].token_ids
    pieces = [llm.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    k = next(
        i
        for i in range(4, len(ids) - 1)
        if len(pieces[i]) > len(pieces[i - 1])
        and len(pieces[i + 1]) > len(pieces[i])
        and "\ufffd" not in pieces[i + 1][len(pieces[i - 1]) :]
    )
    stop = pieces[k + 1][len(pieces[k]) - 1 : len(pieces[k]) + 1]  # last char of token k + first of token k+1
    full = free.outputs[0].text
    [r] = llm.generate([prompt], SamplingParams(max_tokens=24, stop=(stop,), **GREEDY))
    o = r.outputs[0]
    assert o.finish_reason == "stop"
    assert stop not in o.text
    assert o.text == full[: full.index(stop)]
    assert not llm.has_unfinished_requests() and llm.engine.stats.kv_pages_used == 0  # aborted in the engine
    # vLLM's stop_reason: the stop string that ended it (the earlier of two), a stop_token_ids id, else None
    [r] = llm.generate([prompt], SamplingParams(max_tokens=24, stop=("never said", stop), **GREEDY))
    assert r.outputs[0].stop_reason == stop
    [r] = llm.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(ids[5],), **GREEDY))
    assert (r.outputs[0].finish_reason, r.outputs[0].stop_reason) == ("stop", ids[5])
    assert r.outputs[0].token_ids == ids[:ids.index(ids[5]) + 1]
    assert free.outputs[0].stop_reason is None   # the length limit


def test_stream_concatenates_to_generate(llm):
    params = SamplingParams(max_tokens=10, **GREEDY)
    [r] = llm.generate(["Hello world"], params)
    deltas = list(llm.stream("Hello world", params))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == r.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == r.outputs[0].token_ids
    # several prompts interleave in one batch; leaving early aborts the rest
    both = list(llm.stream(["Hello world", "abc"], params))
    first = [d for d in both if d.request_id.endswith("-0")]
    assert "".join(d.text for d in first) == r.outputs[0].text
    assert sum(d.finished for d in both) == 2
    for _ in llm.stream(["Hello world", "abc"], SamplingParams(max_tokens=50, **GREEDY)):
        break
    assert [d for d in llm.step() if not d.finished] == [] and llm.engine.stats.kv_pages_used == 0
    with pytest.raises(ValueError, match="max_batch_sise"):
        LLM(None, max_batch_sise=3)


def test_n_choices_and_seeds(llm):
    [greedy] = llm.generate(["abc"], SamplingParams(max_tokens=6, n=3, **GREEDY))
    assert [o.index for o in greedy.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    p = SamplingParams(max_tokens=8, n=2, seed=5, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True)
    [a] = llm.generate(["abc"], p)
    [b] = llm.generate(["abc"], p)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]  # seeded: reproducible


def test_chat_matches_text_layer_parse(llm):
    # docs/parsers.md §3: streaming parse inside the pipeline == non-streaming parse of the raw text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = llm.chat(messages, SamplingParams(max_tokens=16, **GREEDY))
    o = r.outputs[0]
    prompt = llm.render_chat(messages)
    assert prompt.endswith("]~b]ai\n<think>\n")
    ref = parse_output(o.text, None, "split", prompt)
    assert (o.reasoning, o.content) == (ref.reasoning, ref.content)
    assert o.num_reasoning_tokens > 0
    [batch] = llm.chat([messages], SamplingParams(max_tokens=16, **GREEDY))
    assert batch.outputs[0].text == o.text


def test_too_long_prompt_is_rejected_with_numbers(llm):
    with pytest.raises(ValueError, match=str(llm.max_length)):
        llm.generate([[5] * (llm.max_length + 1)], SamplingParams(max_tokens=1))
    assert not llm.has_unfinished_requests()


def test_reasoning_parser_none_gives_raw_content(llm):
    # issue 5 item 5: --reasoning-parser none = raw text in content, no parsing
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    params = SamplingParams(max_tokens=8, **GREEDY)
    llm.reasoning_parser = "none"
    try:
        o = llm.chat(messages, params).outputs[0]
    finally:
        llm.reasoning_parser = "minimax_m2"
    assert o.reasoning is None and o.content == (o.text or None)


def test_chat_template_override(tiny_random_dir, tmp_path):
    # issue 5 item 4: --chat-template FILE overrides the checkpoint's template
    t = tmp_path / "t.jinja"
    t.write_text("{{ bos_token }}CUSTOM{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}|ai:")
    other = LLM(
        str(tiny_random_dir), chat_template=str(t), dtype="float32", num_kv_pages=16, kv_cache_page_size=16
    )
    assert other.render_chat([{"role": "user", "content": "hi"}]) == "]~!b[CUSTOM|user:hi|ai:"


@pytest.mark.slow  # a subprocess loading tiny-chat
def test_readme_python_api_block_runs_as_written(tmp_path):
    """The README's **Python API** block, run as a user pastes it (a fresh interpreter): it imports
    ``from m2serve import LLM, SamplingParams`` (vLLM's shape, loaded lazily: ``import m2serve`` alone
    loads no torch) and its printed tool call and JSON are what its comments say."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"\*\*Python API\*\*:\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert block.startswith("from m2serve import LLM, SamplingParams")
    script = tmp_path / "api.py"
    script.write_text("import sys, m2serve\nassert 'torch' not in sys.modules\n" + block, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert "name='get_weather'" in out[0] and "arguments='{\"city\": \"Paris\"}'" in out[-2]
    picked = json.loads(out[-1])
    assert picked["city"] in ("Paris", "London", "Tokyo") and isinstance(picked["sunny"], bool)
