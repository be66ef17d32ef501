"""Offline serving throughput: m2serve's engine vs transformers ``generate`` on the same checkpoint.

For each config (``tiny-random`` and the bench config: vocab 32,000, hidden 3072, 48 heads, 8 KV
heads, head_dim 128, rotary_dim 64, intermediate 1536, 2 layers, 32 experts top-8, bf16 weights,
built in a temp dir) and each concurrency c, c requests of --input-len random tokens each generate
--output-len tokens (greedy, EOS ignored), all submitted at once:

* m2serve: ``LLMEngine`` (continuous batching, paged KV cache, chunked prefill within
  --max-batch-input-tokens, default 2048 tokens per step);
* transformers: ``MiniMaxM2ForCausalLM.generate`` on the c prompts as one left-padded batch;
* m2serve-legacy: the same engine with the model's benchmark-only ``legacy_path`` switch (the
  previous per-active-expert loop and padded [B, Lk] K/V gather), for a before/after in one run;
* llama.cpp through llama-cpp-python: skipped with a message (not importable here; when it is, a
  GGUF of the random checkpoint would still be needed, which this script does not build).

Each peer runs in its own subprocess, one after the other, with the same dtype and thread count.
Printed: output tokens/s per peer and the m2serve / peer ratio; for each m2serve path, one decode
step at batch c profiled after the timed run (dispatched aten ops per model forward, host syncs
per forward and per engine step: nonzero, _local_scalar_dense, masked_select, unique*, a bool
index, repeat_interleave without output_size, Tensor.tolist / item; the expert-GEMM share of the
step: process CPU time in mm / grouped_mm ops inside the experts modules, timed op by op,
over the CPU time of that same audited step (the dispatch mode adds tens of microseconds per
op; the wall time of the uninstrumented step before it is printed too); for c = 1, m2serve's time per
decoded token next to the batch-1 decode bound = bytes of weights read per token (attention, router,
the top-k experts of every layer, lm_head, in the compute dtype, plus the KV cache) / streaming-read
bandwidth measured here (a large tensor sum; best of the measurements at the start and next to
each c = 1 run).

    python benchmarks/throughput.py [--configs tiny,bench] [--concurrency 1,8,32]
        [--bench-concurrency 1] [--input-len 512] [--output-len 128] [--dtype float32] [--threads 1]
        [--peers m2serve,m2serve-legacy,transformers]

Issue 17's before/after on the bench config at concurrency 32 (about 25 minutes on a loaded
2-core box):

    python benchmarks/throughput.py --configs bench --bench-concurrency 32 \
        --peers m2serve,m2serve-legacy --input-len 128 --output-len 32

Concurrency: --concurrency for tiny-random (default 1, 8, 32), --bench-concurrency for the bench
config (default 1 only, to keep the default run under 10 minutes on a shared 2-core CPU box, where
c = 8 adds about 3 minutes and c = 32 about 13, three times that under heavy load, and transformers
at c = 32 needs ~13 GB of RAM: pass --bench-concurrency 1,8,32).
Threads default to 1: on a shared 2-core box, 2 OpenMP threads stall on barriers (both peers alike).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIMS = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  rotary_dim=64,
                  intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8, num_hidden_layers=2,
                  vocab_size=32000)
PEERS = ("m2serve", "m2serve-legacy", "transformers")


def prompts(c: int, n: int, vocab: int) -> list[list[int]]:
    """c deterministic pseudo-random prompts of n token ids (same for every peer)."""
    import random

    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(n)] for _ in range(c)]


# ---- step profile: ops, host syncs, expert-GEMM time -----------------------------------------
def step_profile(eng, c: int, legacy: bool) -> dict:
    """Profile one decode step at batch ``c`` (c requests of 16 prompt tokens, all past prefill).

    Returns ops per model forward, host syncs per forward and per engine step (reasons counted),
    the step's wall time without instrumentation, and the expert-GEMM time (aten mm / addmm /
    _grouped_mm inside a MiniMaxM2Experts forward, each op timed around its call)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from m2serve.engine.sampling import SamplingParams
    from m2serve.model.experts import MiniMaxM2Experts

    aten = torch.ops.aten
    sync_ops = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select"}
    gemm_ops = {"aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::bmm", "aten::linear"}
    state = {"in_experts": 0, "in_model": False}

    class Audit(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.syncs: dict[str, int] = {}
            self.model_ops = 0
            self.model_syncs = 0
            self.gemm_s = 0.0

        def sync(self, reason: str) -> None:
            self.syncs[reason] = self.syncs.get(reason, 0) + 1
            self.model_syncs += state["in_model"]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.name()
            self.ops += 1
            self.model_ops += state["in_model"]
            indices = args[1] if len(args) > 1 else []
            bool_index = func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
            if name in sync_ops or name.startswith("aten::unique") or bool_index or (
                    func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None
                    and func is not aten.repeat_interleave.self_int):
                self.sync(name + (" (bool index)" if bool_index else ""))
            t = time.process_time()
            out = func(*args, **kwargs)
            if state["in_experts"] and name in gemm_ops:
                self.gemm_s += time.process_time() - t
            return out

    class HostReads(TorchFunctionMode):
        def __init__(self, audit: Audit):
            super().__init__()
            self.audit = audit

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("tolist", "item"):
                self.audit.sync(f"Tensor.{name}")
            return func(*args, **(kwargs or {}))

    model = eng.runner.model
    model.legacy_path = legacy
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts(c, 16, eng.config.vocab_size)):
        eng.add_request(f"p{i}", p, params)
    while eng.stats.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in eng.scheduler.running):
        eng.step()
    t = time.perf_counter()
    eng.step()                                                  # one decode step, uninstrumented
    step_s = time.perf_counter() - t

    hooks = [m.register_forward_pre_hook(lambda *_: state.__setitem__("in_experts", state["in_experts"] + 1))
             for m in model.modules() if isinstance(m, MiniMaxM2Experts)]
    hooks += [m.register_forward_hook(lambda *_: state.__setitem__("in_experts", state["in_experts"] - 1))
              for m in model.modules() if isinstance(m, MiniMaxM2Experts)]
    hooks.append(model.register_forward_pre_hook(lambda *_: state.__setitem__("in_model", True)))
    hooks.append(model.register_forward_hook(lambda *_: state.__setitem__("in_model", False)))
    with HostReads(Audit()), Audit():
        torch.ones(1) + 1                                       # first use of the modes: ~1.5 s of imports
    audit = Audit()
    with HostReads(audit), audit:
        t = time.process_time()
        eng.step()                                              # the next decode step, audited
        audited_s = time.process_time() - t
    for h in hooks:
        h.remove()
    while eng.has_unfinished_requests():
        eng.step()
    return {"batch": c, "model_ops": audit.model_ops, "model_syncs": audit.model_syncs,
            "step_syncs": sum(audit.syncs.values()), "sync_reasons": audit.syncs,
            "step_s": step_s, "audited_step_s": audited_s, "expert_gemm_s": audit.gemm_s}


# ---- workers (each runs in its own subprocess) -----------------------------------------------
def run_m2serve(path: str, args: argparse.Namespace, legacy: bool = False) -> dict:
    from m2serve.config.engine_args import EngineArgs
    from m2serve.engine.core import LLMEngine
    from m2serve.engine.sampling import SamplingParams

    c, n_in, n_out = args.c, args.input_len, args.output_len
    page = 128
    eng = LLMEngine.from_args(EngineArgs(
        model=path, dtype=args.dtype, kv_cache_format=args.dtype, kv_cache_page_size=page,
        num_kv_pages=c * -(-(n_in + n_out) // page) + 1, max_batch_size=max(c, 1),
        max_batch_input_tokens=args.max_batch_input_tokens))
    eng.runner.model.legacy_path = legacy
    V = eng.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.add_request("warm", prompts(1, 16, V)[0], warm)
    while eng.has_unfinished_requests():
        eng.step()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(c, n_in, V)):
        eng.add_request(f"r{i}", p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    generated = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            generated += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    itl = sum(last[r] - first[r] for r in first) / len(first) / max(n_out - 1, 1)
    return {"tok_s": generated / wall, "wall_s": wall, "tokens": generated,
            "ttft_s": sum(first.values()) / len(first) - t0, "s_per_decode_token": itl,
            "profile": step_profile(eng, c, legacy)}


def run_transformers(path: str, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    c, n_in, n_out = args.c, args.input_len, args.output_len
    model = transformers.MiniMaxM2ForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    V = model.config.vocab_size
    gen = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts(1, 16, V)), max_new_tokens=2, min_new_tokens=2, **gen)
        ids = torch.tensor(prompts(c, n_in, V))           # equal lengths: the padding mask is all ones
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, **gen)
        wall = time.perf_counter() - t0
    generated = int((out.shape[1] - n_in) * c)
    return {"tok_s": generated / wall, "wall_s": wall, "tokens": generated}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "transformers":
        res = run_transformers(args.model, args)
    else:
        res = run_m2serve(args.model, args, legacy=args.worker == "m2serve-legacy")
    print("RESULT " + json.dumps(res), flush=True)


# ---- driver ----------------------------------------------------------------------------------
def stream_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Streaming-read bandwidth in bytes/s: best of 5 sums over a ``gib`` GiB fp32 tensor.
    On a shared machine other jobs lower it; the driver keeps the best of several measurements."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2 ** 30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def decode_bytes_per_token(model_dir: Path, dtype: str, context: int) -> int:
    """Bytes one batch-1 decode step reads: attention, norms, router, the top-k experts of every
    layer and lm_head in the compute dtype (the embedding row is negligible), plus the KV cache
    of ``context`` tokens in the same dtype."""
    from m2serve.config.model_config import MiniMaxM2Config

    cfg = MiniMaxM2Config.from_pretrained(model_dir)
    H, L, D = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    elem = {"float32": 4, "bfloat16": 2}[dtype]
    attn = H * cfg.q_size * 2 + H * cfg.kv_size * 2 + cfg.q_size + cfg.kv_size      # q,o,k,v + qk norms
    experts = cfg.num_experts_per_tok * 3 * H * cfg.intermediate_size
    router = (cfg.num_local_experts * H + cfg.num_local_experts) * 4 // elem        # fp32 gate + bias
    per_layer = attn + experts + router + 2 * H
    weights = (L * per_layer + H + cfg.vocab_size * H) * elem
    kv = context * L * 2 * cfg.num_key_value_heads * D * elem
    return weights + kv


def spawn(peer: str, model_dir: Path, c: int, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", peer, "--model", str(model_dir), "--c", str(c),
           "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--dtype", a.dtype,
           "--threads", str(a.threads), "--max-batch-input-tokens", str(a.max_batch_input_tokens)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    why = "killed (SIGKILL: out of memory?)" if p.returncode == -9 else f"exit code {p.returncode}"
    tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if "Error" in ln][-1:]
    return {"error": f"{why} {tail[0] if tail else ''}".strip()}


def build(name: str, root: Path) -> Path:
    """Build the checkpoint in a subprocess (its random weights would otherwise stay resident in
    the driver while the peers run)."""
    if name not in ("tiny", "bench"):
        raise SystemExit(f"unknown config {name!r}: use tiny or bench")
    out = root / name
    dims = "{}" if name == "tiny" else json.dumps(BENCH_DIMS)
    code = ("import json, sys; from m2serve.checkpoints.tiny_random import build_tiny_random; "
            "build_tiny_random(sys.argv[1], **json.loads(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(out), dims], check=True)
    return out


def main(a: argparse.Namespace) -> None:
    import importlib.util

    bw = stream_bandwidth(a.threads)
    why = ("llama-cpp-python is not importable" if importlib.util.find_spec("llama_cpp") is None
           else "llama-cpp-python is importable but no GGUF of these checkpoints is built here")
    print(f"# llama.cpp skipped: {why}")
    print(f"# streaming-read bandwidth: {bw / 1e9:.2f} GB/s ({a.threads} threads); dtype {a.dtype}; "
          f"{a.input_len} in / {a.output_len} out per request")
    with tempfile.TemporaryDirectory(prefix="m2serve-bench-") as tmp:
        for name in a.configs.split(","):
            t = time.perf_counter()
            model_dir = build(name, Path(tmp))
            print(f"\n## {name} (checkpoint built in {time.perf_counter() - t:.0f} s)")
            print(f"{'c':>3} {'peer':<13} {'tok/s':>9} {'wall s':>8} {'m2serve x':>10}")
            conc = a.bench_concurrency if name == "bench" else a.concurrency
            for c in (int(x) for x in conc.split(",")):
                res = {peer: spawn(peer, model_dir, c, a) for peer in a.peers.split(",")}
                ours = res.get("m2serve", {}).get("tok_s")
                for peer, r in res.items():
                    if "tok_s" not in r:
                        print(f"{c:>3} {peer:<13} {'skipped' if 'skip' in r else 'failed'}: "
                              f"{r.get('skip') or r.get('error')}")
                        continue
                    ratio = "" if peer == "m2serve" or not ours else f"{ours / r['tok_s']:.2f}x"
                    print(f"{c:>3} {peer:<13} {r['tok_s']:>9.1f} {r['wall_s']:>8.1f} {ratio:>10}")
                print_profiles(res)
                if c == 1 and "s_per_decode_token" in res.get("m2serve", {}):
                    bw = max(bw, stream_bandwidth(a.threads))   # re-measured: the box is shared
                    need = decode_bytes_per_token(model_dir, a.dtype, a.input_len + a.output_len // 2)
                    bound = need / bw
                    got = res["m2serve"]["s_per_decode_token"]
                    print(f"    batch-1 decode: {got * 1e3:.2f} ms/token measured, bound "
                          f"{bound * 1e3:.2f} ms/token ({need / 1e6:.1f} MB/token at {bw / 1e9:.2f} GB/s)"
                          f" -> {got / bound:.2f}x the bound; TTFT {res['m2serve']['ttft_s']:.2f} s")


def print_profiles(res: dict) -> None:
    """One line per m2serve path: its profiled decode step (see :func:`step_profile`)."""
    for peer, r in res.items():
        p = r.get("profile")
        if not p:
            continue
        share = p["expert_gemm_s"] / p["audited_step_s"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(p["sync_reasons"].items())) or "none"
        print(f"    {peer:<14} decode step at batch {p['batch']}: {p['step_s'] * 1e3:.0f} ms wall, "
              f"{p['model_ops']} ops and {p['model_syncs']} host syncs per model forward, "
              f"{p['step_syncs']} syncs per engine step ({reasons}); expert GEMMs "
              f"{p['expert_gemm_s'] * 1e3:.0f} ms = {share:.0%} of the audited step "
              f"({p['audited_step_s'] * 1e3:.0f} ms, CPU times)")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,bench")
    p.add_argument("--concurrency", default="1,8,32", help="for tiny-random")
    p.add_argument("--bench-concurrency", default="1", help="for the bench config")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch-input-tokens", type=int, default=2048,
                   help="m2serve's per-step token budget (prefill chunks + decodes)")
    p.add_argument("--peers", default="m2serve,transformers",
                   help=f"comma-separated, from {','.join(PEERS)} (m2serve-legacy: the previous model path)")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--c", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    worker(args) if args.worker else main(args)
