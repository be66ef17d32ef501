"""n-gram or EAGLE-3 speculative decoding against plain decoding on tiny-chat, rows alternated in one
process (issue 34 and 35 "must show", docs/serving.md §13, §14).

Held-out tiny-chat prompts (tools/tiny_chat/data.py) of two kinds: ``tool_result`` turns (the answer
restates the tool's result, so the prompt holds most of what is generated) and ``plain`` turns (little
to copy). For each kind and batch size (1: the requests one after another, ``max_batch_size`` 1; 8: all
in one batch) two engines over the same checkpoint and threads decode the same requests, speculation
off and on (``--k`` drafted tokens, prompt lookup ``--lookup-min``..``--lookup-max``, or with
``--method eagle3 --draft DIR`` an EAGLE-3 draft), alternately,
``--repeats`` times after one warm-up each, with the prefix cache off so every repeat does the same
work. Printed per row: the medians of generated tokens / wall second (prefill included, as a client
sees it) and the median of the per-pair ratios, the same per process CPU second (what the steps
computed: less sensitive to other processes on a shared machine), the median ratio of decode
tokens per CPU second (the steps with no prompt in them: every request added and past its first
token, so prefill and TTFT are left out; what speculation changes), the mean accepted length (tokens
per verified draft, 1 + accepted / drafts) and the acceptance rate per draft position (accepted at
position i / drafts).
Every repeat checks that both engines produced the same tokens (greedy, and for ngram the seeded
``--temperature`` when non-zero; eagle3's sampled tokens follow the same distribution, not the same
draws). The first and last lines give the CPU model, ISA and load average
(formats.py ``machine_line``).

    python benchmarks/speculative.py [--per-kind 8] [--repeats 3] [--k 4] [--threads 1] [--batches 1,8]
        [--method eagle3 --draft DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from formats import machine_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.tiny_chat import data  # noqa: E402

from m2serve.config.engine_args import EngineArgs  # noqa: E402
from m2serve.engine.core import LLMEngine  # noqa: E402
from m2serve.engine.sampling import SamplingParams  # noqa: E402
from m2serve.serve import chat_pipeline as cp  # noqa: E402
from m2serve.serve.llm import LLM  # noqa: E402

CKPT = REPO / "src/m2serve/checkpoints/tiny-chat"


def prompt_ids(llm: LLM, kind: str, n: int, max_tokens: int) -> list[list[int]]:
    """The chat-template token ids of the first ``n`` held-out prompts of ``kind``."""
    ctx = cp.TextContext.of(llm)
    return [cp.prepare_blocking(ctx, cp.ChatJob(list(ex.prompt_messages), ex.tools or None,
                                                params=SamplingParams(max_tokens=max_tokens))).ids
            for ex in data.eval_subset(kind, n, seed=4034)]


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
        ) -> tuple[dict, float, float, int, float]:
    """Generate every prompt to completion: (request id -> tokens, wall seconds, process CPU seconds,
    decode tokens, decode CPU seconds). The decode part is the steps with no prompt in them (no
    request's first token out of them, and no request left running without one, i.e. halfway
    through a chunked prompt): the tokens they emit and their process CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"b{i}", p, sp)
    out: dict[str, list[int]] = {}
    dec_tokens, dec_cpu = 0, 0.0
    while engine.has_unfinished_requests():
        c = time.process_time()
        outs = engine.step()
        dc = time.process_time() - c
        if not any(o.new_token_ids and o.request_id not in out for o in outs) and \
                all(r.num_output_tokens for s in engine.schedulers for r in s.running):
            dec_cpu += dc
            dec_tokens += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, time.perf_counter() - t0, time.process_time() - c0, dec_tokens, dec_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=CKPT)
    ap.add_argument("--per-kind", type=int, default=8, help="prompts per kind (the batch-8 row's batch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--method", choices=("ngram", "eagle3"), default="ngram")
    ap.add_argument("--draft", type=Path, help="the EAGLE-3 draft's directory (--method eagle3)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weight-dequant", default="auto")
    ap.add_argument("--kinds", default="tool_result,plain")
    ap.add_argument("--batches", default="1,8", help="batch sizes to run (comma-separated)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    if args.method == "eagle3":
        if args.draft is None:
            ap.error("--method eagle3 needs --draft DIR")
        spec = {"method": "eagle3", "num_speculative_tokens": args.k, "model": str(args.draft)}
    # eagle3 sampled output is distributed as plain sampling's, not token-identical (docs/serving.md §14)
    same_tokens = args.method == "ngram" or args.temperature == 0
    print(machine_line())
    # threads= on every engine: LLM applies the thread rule (docs/serving.md §12), which would
    # otherwise replace --threads by one thread per physical core
    llm = LLM(str(args.model), dtype=args.dtype, kv_cache_format=args.dtype, num_kv_pages=8,
              threads=args.threads)
    print(f"model {args.model} | {args.dtype} | weight_dequant {args.weight_dequant} | "
          f"threads {torch.get_num_threads()} "
          f"| speculative {spec} | max_tokens {args.max_tokens} | temperature {args.temperature} | "
          f"{args.repeats} alternated repeats, medians")
    print(f"{'kind':<12} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
          f"{'plain tok/cpu-s':>16} {'spec tok/cpu-s':>15} {'ratio':>6} {'decode ratio':>12} "
          f"{'accepted len':>13}  acceptance per position")
    for kind in args.kinds.split(","):
        prompts = prompt_ids(llm, kind, args.per_kind, args.max_tokens)
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
                  for i in range(len(prompts))]
        for batch in (int(b) for b in args.batches.split(",")):
            engines = {}
            for name, cfg in (("plain", None), ("spec", spec)):
                engines[name] = LLMEngine.from_args(EngineArgs(
                    model=str(args.model), dtype=args.dtype, kv_cache_format=args.dtype, num_kv_pages=64,
                    max_batch_size=batch, enable_prefix_caching=False, weight_dequant=args.weight_dequant,
                    speculative_config=cfg, threads=args.threads))
                run(engines[name], prompts, params)   # warm-up
            base = engines["spec"].stats
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            cpu: dict[str, list[float]] = {"plain": [], "spec": []}
            dec: dict[str, list[float]] = {"plain": [], "spec": []}
            for _ in range(args.repeats):
                outs = {}
                for name in ("plain", "spec"):
                    outs[name], dt, ct, dn, dc = run(engines[name], prompts, params)
                    n = sum(len(t) for t in outs[name].values())
                    rates[name].append(n / dt)
                    cpu[name].append(n / ct)
                    dec[name].append(dn / dc if dc > 0 else float("nan"))   # nan: no decode step
                if same_tokens and outs["plain"] != outs["spec"]:
                    raise SystemExit(f"{kind} batch {batch}: speculative tokens differ from plain decoding")
            st = engines["spec"].stats
            drafts = st.spec_drafts - base.spec_drafts
            accepted = st.spec_accepted_tokens - base.spec_accepted_tokens
            per_pos = [a - (base.spec_accepted_per_pos[i] if i < len(base.spec_accepted_per_pos) else 0)
                       for i, a in enumerate(st.spec_accepted_per_pos)]
            ratio = statistics.median(s / p for p, s in zip(rates["plain"], rates["spec"]))
            cpu_ratio = statistics.median(s / p for p, s in zip(cpu["plain"], cpu["spec"]))
            dec_ratio = statistics.median(s / p for p, s in zip(dec["plain"], dec["spec"]))
            pos = " ".join(f"{a / drafts:.2f}" for a in per_pos) if drafts else "-"
            print(f"{kind:<12} {batch:>5} {statistics.median(rates['plain']):>12.1f} "
                  f"{statistics.median(rates['spec']):>11.1f} {ratio:>5.2f}x "
                  f"{statistics.median(cpu['plain']):>16.1f} {statistics.median(cpu['spec']):>15.1f} "
                  f"{cpu_ratio:>5.2f}x {dec_ratio:>11.2f}x "
                  f"{(1 + accepted / drafts) if drafts else 1.0:>13.2f}  {pos}", flush=True)
    if same_tokens:
        print("same tokens with and without speculation in every repeat")
    print(machine_line())


if __name__ == "__main__":
    main()
