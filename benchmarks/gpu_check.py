"""Prepared GPU check of the serving-scale forward (issue 17 item 5): one script, one GPU, < 4 min.

    PYTHONPATH=src python3 benchmarks/gpu_check.py            # on the GPU machine
    PYTHONPATH=src python3 benchmarks/gpu_check.py --cpu-smoke  # its CPU-runnable parts, tiny dims

Needs torch only (any torch with CUDA; written for torch 2.11 / Python 3.12): it imports the
model layers (config, formats, model) and nothing from serve/, text/ or engine/, builds both
models in process with seeded random weights (no checkpoint files, no tokenizer), and:

(a) correctness: CUDA bf16 logits vs CPU fp32 logits (the same weights) on the tiny-random dims
    and the bench config, for a ragged prefill (3 prompts, every position) and 4 decode steps.
    bf16 tolerance: >= 95% of the logit rows within max |Δ| <= 0.05 * max |logit| and top-1
    agreement >= 0.9 (a bf16 router input can flip a near-tied expert choice, which moves a few
    rows by more: on CPU tiny dims 3 of 184 rows, the same rows with the previous loop path);
    also the new path vs the previous one (``legacy_path``) in bf16 on the GPU, same rule. Then
    CUDA fp32 (grouped_mm in fp32 where the GPU's torch accepts it, else the loop fallback; which
    one is printed), every row within 1e-3 * max(1, max |logit|).
(b) speed (bench config, bf16): decode tokens/s at batch 1, 32 and 128 (each request 128 tokens
    of context; the step includes building the batch on the host), a 512-token prefill, and
    ``torch.compile(mode="reduce-overhead")`` of the decode step at batch 32 (compile time, step
    time, recompiles; a failure is reported, not fatal).
(c) what ran: the top CUDA kernels of one batch-32 decode step (torch.profiler), whether
    grouped_mm ran, the host syncs of one forward counted two ways (CUDA sync debug mode
    warnings; dispatched ops that read back: nonzero, _local_scalar_dense, unique*), and the
    dispatched ops per forward.

Figures are printed and, when ``$OUT`` is set, written to ``$OUT/gpu_check.json``. Without a
CUDA device (and without --cpu-smoke) it prints that and exits 0.

``--part attention`` runs instead the check of the Triton paged attention kernel
(benchmarks/gpu_attention.py: correctness against ``attend`` and decode time against the
bandwidth bound; < 6 min on one H200; needs triton 3.6, no more). ``--part moe`` runs the check
of the Triton fused MoE (benchmarks/gpu_moe.py: every stored format at 256 experts top-8 against
a GPU fp32 reference and the torch grouped_mm path; decode time against the bandwidth bound of
the expert bytes read; not run on a GPU yet).

``--part weights`` (quantised weights kept as stored, docs/kernels.md §4) instead: FP8 weights
generated on the device in memory at full width (hidden 3072, 2 layers; no checkpoint files):

(w1) the Triton block-scaled FP8 linear, W8A16 and W8A8, vs a GPU fp32 reference (formats/
     ``dequantize_fp8_block`` in fp32 + an fp32 matmul; W8A8 also vs the torch quantiser
     ``quantize_fp8_act_groups`` + the same matmul), q_proj and o_proj shapes at 1, 32 and 512
     rows, with the time per call next to ``F.linear`` on the bf16 weight, and TP slices that split a
     128-wide scale band (q_proj rows and o_proj columns from 192, row0 / col0 64; untimed); OK when
     both are within
     1e-2 of max |reference| (W8A16 only under --cpu-smoke: the interpreter's fp8 rounding is
     not the GPU's);
(w2) decode tokens/s at batch 1 and 32 of the FP8 model (attention on the Triton linear, experts
     on the torch reference) in both modes vs the bf16 model, in the same run, with each model's
     resident weight bytes and its kernel choices;
(w3) the load time of a synthetic FP8 checkpoint (bench dims, written to a temporary directory)
     with ``load_model`` on the GPU: codes and scales copied as stored, no host dequantisation.
Its figures go to ``$OUT/gpu_check_weights.json``.

``--part engine`` (issue 29 item 4) times the engine's decode step on the bench config in bf16:
the step built as the runner builds it (``ragged_batch`` into persistent ``StepBuffers``, one
host-to-device copy), the attention backend ``auto`` chose (triton on a GPU), at batch 1, 32 and
128 with 128 tokens of context each: eager (host build + forward per step) and the engine's CUDA-graph
decode path (model/cuda_graphs.py ``CUDAGraphRunner``: the step written into the fixed-address
buffers, one copy, the bucket's graph replayed; max_length GRAPH_MAX_LENGTH; also that static
forward run eagerly, and the capture time), each as tokens/s and as a ratio to the bandwidth bound
measured in the same run (every weight byte the step needs — the experts counted as
min(E, batch · top-k) of E — and every KV byte read once, at the device's copy rate measured in
the same run). The graph's logits are compared with the static forward's
(same kernels: expected equal) and with the eager ragged step's (within bf16 rounding). Written to
``$OUT/gpu_check_engine.json``.
Not yet run on a GPU. ``--cpu-smoke`` runs it on tiny dims on CPU, eager only (no graphs on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.formats.fp8 import PackedFP8, dequantize_fp8_block, quantize_fp8_act_groups, quantize_fp8_block
from m2serve.model.decoder import MiniMaxM2ForCausalLM
from m2serve.model.experts import has_grouped_mm
from m2serve.model.simple_cache import SimpleKVCache

# = m2serve/checkpoints/tiny_random.py TINY_DIMS (importing it needs `tokenizers`; a test checks
# they are equal) and benchmarks/forward.py BENCH_DIMS
TINY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=128, rotary_dim=64,
            intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
            max_position_embeddings=4096, vocab_size=2048)
BENCH = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128, rotary_dim=64,
             intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8, num_hidden_layers=2,
             vocab_size=32000, max_position_embeddings=4096)
PROMPT_LENS = (5, 37, 130)
BF16_TOL, FP32_TOL, TOP1_MIN = 0.05, 1e-3, 0.9
PAGE = 16
GRAPH_MAX_LENGTH = 4096  # --part engine: the static decode path's max_length (block-table width, splits)
READ_BACK_OPS = ("aten::nonzero", "aten::_local_scalar_dense", "aten::unique", "aten::_unique",
                 "aten::masked_select")


def config(dims: dict) -> MiniMaxM2Config:
    """A MiniMax-M2 config with ``dims`` (everything else the release's defaults)."""
    return MiniMaxM2Config.from_dict({"architectures": ["MiniMaxM2ForCausalLM"], **dims})


def random_state(model: MiniMaxM2ForCausalLM, seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 CPU values for every parameter: matrices ~ N(0, 1/fan_in), norm gammas
    1 + N(0, 0.1²), router bias N(0, 0.01²), embedding N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in name:
            v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        elif p.dim() >= 2:
            v = torch.randn(p.shape, generator=g)
        elif "bias" in name:
            v = torch.randn(p.shape, generator=g) * 0.01
        else:
            v = 1 + 0.1 * torch.randn(p.shape, generator=g)
        state[name] = v
    return state


def build(cfg: MiniMaxM2Config, state: dict[str, torch.Tensor], dtype: torch.dtype,
          device: str) -> MiniMaxM2ForCausalLM:
    """The model on ``device`` in ``dtype`` (router gate and bias stay fp32) holding ``state``."""
    with torch.device(device):
        model = MiniMaxM2ForCausalLM(cfg, dtype=dtype)
    for name, p in model.named_parameters():
        p.data.copy_(state[name])
    return model.eval()


def prompts(cfg: MiniMaxM2Config) -> list[list[int]]:
    return [[(7919 * i + 13 * n) % cfg.vocab_size for i in range(n)] for n in PROMPT_LENS]


def run_logits(model: MiniMaxM2ForCausalLM, cfg: MiniMaxM2Config, kv_dtype: torch.dtype,
               device: str) -> torch.Tensor:
    """fp32 CPU logits of a ragged prefill (every position) + 4 teacher-forced decode steps
    (the same fixed tokens for every model, so the rows are comparable)."""
    cache = SimpleKVCache.create(cfg, num_pages=64, page_size=PAGE, dtype=kv_dtype, device=device)
    ps = prompts(cfg)
    out = [model(cache.batch([(i, p) for i, p in enumerate(ps)], return_n_logits=10**6), cache.storage)]
    for step in range(4):
        out.append(model(cache.batch([(i, [(i + 3 * step) % cfg.vocab_size]) for i in range(len(ps))]),
                         cache.storage))
    return torch.cat(out).float().cpu()


def compare(got: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    """max |Δ|, max |ref|, their ratio, the fraction of rows whose max |Δ| <= tol * max(1,
    max |ref|), and the top-1 agreement of two logit sets [rows, V]."""
    scale = max(float(ref.abs().max()), 1.0)
    rows = (got - ref).abs().amax(-1)
    return {"max_abs_diff": float(rows.max()), "max_abs_logit": float(ref.abs().max()),
            "rel": float(rows.max()) / scale, "rows_within": float((rows <= tol * scale).float().mean()),
            "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), "tolerance": tol}


def within(c: dict, bf16: bool) -> bool:
    """The tolerance rule of the module docstring (a)."""
    if bf16:
        return c["rows_within"] >= 0.95 and c["top1_agree"] >= TOP1_MIN
    return c["rows_within"] == 1.0


class ReadBacks(TorchDispatchMode):
    """Counts dispatched ops and the ones that read a device value back to the host."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.read_backs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.name().startswith(READ_BACK_OPS):
            self.read_backs.append(func.name())
        return func(*args, **(kwargs or {}))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_setup(model, cfg, batch: int, context: int, dtype, device):
    """A pool with ``batch`` requests of ``context`` prefilled tokens; returns (cache, step fn)."""
    pages = batch * (-(-(context + 64) // PAGE))
    cache = SimpleKVCache.create(cfg, num_pages=pages, page_size=PAGE, dtype=dtype, device=device)
    for i in range(batch):
        model(cache.batch([(i, [(i + j) % cfg.vocab_size for j in range(context)])]), cache.storage)

    def step(tok: int = 1):
        return model(cache.batch([(i, [tok]) for i in range(batch)]), cache.storage)
    return cache, step


def time_decode(model, cfg, batch: int, dtype, device, steps: int) -> float:
    """Decode tokens/s at ``batch`` (host batch building included)."""
    _, step = decode_setup(model, cfg, batch, 128, dtype, device)
    step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return batch * steps / (time.perf_counter() - t)


def time_prefill(model, cfg, n: int, dtype, device) -> float:
    """Prefill tokens/s of one ``n``-token prompt (best of 3)."""
    best = 0.0
    for r in range(4):
        cache = SimpleKVCache.create(cfg, num_pages=n // PAGE + 2, page_size=PAGE, dtype=dtype, device=device)
        sync(device)
        t = time.perf_counter()
        model(cache.batch([(r, [(r + j) % cfg.vocab_size for j in range(n)])]), cache.storage)
        sync(device)
        if r:
            best = max(best, n / (time.perf_counter() - t))
    return best


def count_syncs(model, cfg, dtype, device) -> dict:
    """One batch-32 decode forward: CUDA sync-debug warnings and read-back ops, dispatched ops."""
    _, step = decode_setup(model, cfg, 32, 64, dtype, device)
    step()
    sync(device)
    audit = ReadBacks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with audit:
                step()
        finally:
            if device.startswith("cuda"):
                torch.cuda.set_sync_debug_mode("default")
    sync_warnings = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
    return {"dispatched_ops": audit.ops, "read_back_ops": audit.read_backs,
            "cuda_sync_warnings": len(sync_warnings), "cuda_sync_examples": sync_warnings[:5]}


def top_kernels(model, cfg, dtype, device, n: int = 15) -> list[dict]:
    """The ``n`` CUDA kernels taking the most time in one batch-32 decode step."""
    from torch.profiler import ProfilerActivity, profile

    _, step = decode_setup(model, cfg, 32, 64, dtype, device)
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if getattr(e, "device_time_total", 0) > 0]
    rows.sort(key=lambda r: -r[1])
    return [{"kernel": k[:140], "us": round(t, 1), "calls": c} for k, t, c in rows[:n]]


def compiled_decode(model, cfg, dtype, device) -> dict:
    """torch.compile(mode="reduce-overhead") of the batch-32 decode step: compile + step times."""
    try:
        import torch._dynamo as dynamo

        name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo.config, name, 8)
        compiled = torch.compile(model.forward, mode="reduce-overhead")
        cache, _ = decode_setup(model, cfg, 32, 64, dtype, device)
        t = time.perf_counter()
        compiled(cache.batch([(i, [1]) for i in range(32)]), cache.storage)
        sync(device)
        first = time.perf_counter() - t
        times = []
        for _ in range(6):
            t = time.perf_counter()
            compiled(cache.batch([(i, [1]) for i in range(32)]), cache.storage)
            sync(device)
            times.append(time.perf_counter() - t)
        counters = {k: dict(v) for k, v in dynamo.utils.counters.items() if k in ("stats", "graph_break")}
        return {"ok": True, "first_call_s": first, "step_ms": [round(x * 1e3, 2) for x in times],
                "tok_s_last": 32 / times[-1], "dynamo_counters": counters}
    except Exception as e:  # reported, not fatal: the point is to learn what breaks
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}


def check(device: str, smoke: bool) -> dict:
    """Every figure of the module docstring (``smoke``: tiny dims only, small batches, CPU)."""
    out: dict = {"torch": torch.__version__, "device": device,
                 "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None}
    sets = {"tiny": TINY} if smoke else {"tiny": TINY, "bench": BENCH}
    for name, dims in sets.items():
        cfg = config(dims)
        with torch.device("meta"):
            shape_model = MiniMaxM2ForCausalLM(cfg)
        state = random_state(shape_model, seed=0)
        ref = run_logits(build(cfg, state, torch.float32, "cpu"), cfg, torch.float32, "cpu")
        res = {}
        for label, dtype, tol in (("bf16", torch.bfloat16, BF16_TOL), ("fp32", torch.float32, FP32_TOL)):
            model = build(cfg, state, dtype, device)
            got = run_logits(model, cfg, dtype, device)
            res[label] = compare(got, ref, tol)
            if label == "bf16":
                model.legacy_path = True
                res["bf16_vs_legacy_bf16"] = compare(got, run_logits(model, cfg, dtype, device), tol)
                res["bf16_vs_legacy_bf16"]["ok"] = within(res["bf16_vs_legacy_bf16"], True)
            res[label]["grouped_mm"] = has_grouped_mm(dtype, torch.device(device))
            res[label]["ok"] = within(res[label], label == "bf16")
            del model
        out[f"logits_{name}"] = res
        print(f"[a] {name}: " + "; ".join(
            f"{k} rel {v['rel']:.2e} rows {v['rows_within']:.3f} top1 {v['top1_agree']:.3f} "
            f"grouped_mm {v.get('grouped_mm')} ok {v['ok']}" for k, v in res.items()))
    cfg = config(TINY if smoke else BENCH)
    with torch.device("meta"):
        shape_model = MiniMaxM2ForCausalLM(cfg)
    dtype = torch.bfloat16
    model = build(cfg, random_state(shape_model, seed=1), dtype, device)
    batches, steps = ((1, 4), 2) if smoke else ((1, 32, 128), 20)
    speed = {f"decode_b{b}_tok_s": time_decode(model, cfg, b, dtype, device, steps) for b in batches}
    n = 64 if smoke else 512
    speed[f"prefill_{n}_tok_s"] = time_prefill(model, cfg, n, dtype, device)
    b = batches[-1] if smoke else 32
    model.legacy_path = True  # the previous path (loop experts, padded gather), same run
    speed[f"legacy_decode_b{b}_tok_s"] = time_decode(model, cfg, b, dtype, device, steps)
    model.legacy_path = False
    out["speed_bf16"] = speed
    print("[b] " + ", ".join(f"{k} {v:.1f}" for k, v in speed.items()))
    out["syncs"] = count_syncs(model, cfg, dtype, device)
    print(f"[c] syncs: {out['syncs']}")
    if device.startswith("cuda"):
        out["compile_reduce_overhead_b32"] = compiled_decode(model, cfg, dtype, device)
        print(f"[b] compile: {out['compile_reduce_overhead_b32']}")
        out["top_kernels_b32"] = top_kernels(model, cfg, dtype, device)
        for k in out["top_kernels_b32"]:
            print(f"[c] {k['us']:>10.1f} us x{k['calls']:<4} {k['kernel']}")
    return out


def copy_rate(device: str, nbytes: int) -> float:
    """Device copy rate in bytes/s (read + written) of ``dst.copy_(src)`` over ``nbytes``, best of 5."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def engine_decode(model, cfg, batch: int, context: int, dtype, device: str, steps: int, rate: float,
                  graphs: bool) -> dict:
    """Decode tokens/s of ``batch`` requests at ``context`` tokens, eager (the runner's host build
    into persistent buffers + forward, per step) and, on CUDA, replaying a CUDA graph of the
    forward; and the bandwidth bound: (weight bytes + KV bytes of the step) / copy rate."""
    from m2serve.model.batch import StepBuffers, ragged_batch

    pages_per = -(-(context + steps + 3) // PAGE)
    cache = SimpleKVCache.create(cfg, num_pages=batch * pages_per + 1, page_size=PAGE, dtype=dtype,
                                 device=device)  # + the padding rows' page
    tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(batch)]
    buffers = StepBuffers(torch.device(device))
    model(ragged_batch([[(i + j) % cfg.vocab_size for j in range(context)] for i in range(batch)],
                       [context] * batch, tables, [1] * batch, PAGE, device, buffers=buffers), cache.storage)

    def step(k: int):
        b = ragged_batch([[1]] * batch, [context + k] * batch, tables, [1] * batch, PAGE, device,
                         buffers=buffers)
        return model(b, cache.storage)
    step(1)
    sync(device)
    t = time.perf_counter()
    for k in range(steps):
        step(2 + k)
    sync(device)
    eager = batch * steps / (time.perf_counter() - t)
    experts = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n}
    touched = min(cfg.num_local_experts, batch * cfg.num_experts_per_tok) / cfg.num_local_experts
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(experts.values()) * \
        (1 - touched)
    kv_bytes = 2 * batch * context * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * \
        torch.empty(0, dtype=dtype).element_size()
    bound = batch / ((weight_bytes + kv_bytes) / rate)
    out = {"eager_tok_s": eager, "bound_tok_s": bound, "eager_over_bound": eager / bound}
    if graphs:
        try:  # the engine's static decode path (model/cuda_graphs.py), one bucket = this batch
            from m2serve.model.cuda_graphs import CUDAGraphRunner

            pad = cache.storage.num_pages - 1  # the pool's last page, outside every table
            ctx = [context + steps + 2] * batch   # the position after the eager steps
            ref = model(ragged_batch([[1]] * batch, ctx, tables, [1] * batch, PAGE, device, buffers=buffers),
                        cache.storage).float()
            first = {}
            for key, capture in (("static_eager", False), ("graph", True)):
                t = time.perf_counter()
                runner = CUDAGraphRunner(model, cache.storage, [batch], GRAPH_MAX_LENGTH, pad, capture)
                sync(device)
                out[f"{key}_setup_s"] = time.perf_counter() - t
                first[key] = runner.run([1] * batch, ctx, tables).clone()
                sync(device)
                t = time.perf_counter()
                for _ in range(steps):  # host writes + one copy + forward or replay, as the engine's step
                    runner.run([1] * batch, ctx, tables)
                sync(device)
                g = batch * steps / (time.perf_counter() - t)
                out |= {f"{key}_tok_s": g, f"{key}_over_bound": g / bound, f"{key}_over_eager": g / eager}
            # the replay computes what the same static forward computes eagerly (same kernels: 0 expected),
            # and the eager ragged step's logits within bf16 rounding (its split count may differ)
            out["graph_vs_static_eager_max_abs"] = float((first["graph"] - first["static_eager"]).abs().max())
            out["graph_vs_ragged_eager_max_abs"] = float((first["graph"] - ref).abs().max())
            out["ragged_eager_max_abs_logit"] = float(ref.abs().max())
        except Exception as e:  # reported, not fatal: the point is to learn what does not capture
            out["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def engine_part(device: str, smoke: bool) -> int:
    """``--part engine`` (module docstring)."""
    t = time.perf_counter()
    cfg = config(TINY if smoke else BENCH)
    with torch.device("meta"):
        shape_model = MiniMaxM2ForCausalLM(cfg, attention_backend="torch")
    dtype = torch.bfloat16
    with torch.device(device):
        model = MiniMaxM2ForCausalLM(cfg, dtype=dtype)
    state = random_state(shape_model, seed=1)
    for name, p in model.named_parameters():
        p.data.copy_(state[name])
    model.eval()
    rate = copy_rate(device, 2**20 if smoke else 2**31)
    out = {"torch": torch.__version__, "device": device, "attention_backend": model.attention_backend,
           "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
           "copy_rate_gb_s": rate / 1e9, "decode": {}}
    for b in ((1, 4) if smoke else (1, 32, 128)):
        r = engine_decode(model, cfg, b, 128, dtype, device, 2 if smoke else 20, rate,
                          graphs=device.startswith("cuda"))
        out["decode"][f"b{b}"] = r
        print(f"[engine] batch {b}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in r.items()))
    out["wall_s"] = time.perf_counter() - t
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_check_engine.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {path}")
    print(f"gpu_check --part engine: done in {out['wall_s']:.0f} s")
    return 0


def _kernel_part(name: str, check, device: str, smoke: bool) -> int:
    """Run one Triton kernel part's ``check(device, smoke)`` (a dict with ``ok``), write
    ``$OUT/gpu_check_<name>.json`` when OUT is set, print the verdict; 0 when ``ok``, else 1."""
    t = time.perf_counter()
    out = {"torch": torch.__version__, "device": device,
           "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
           **check(device, smoke)}
    out["wall_s"] = time.perf_counter() - t
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], f"gpu_check_{name}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {path}")
    print(f"gpu_check --part {name}: {'OK' if out['ok'] else 'OUT OF TOLERANCE'} in {out['wall_s']:.0f} s")
    return 0 if out["ok"] else 1


def attention_part(device: str, smoke: bool) -> int:
    """``--part attention``: benchmarks/gpu_attention.py (imported here: it needs triton)."""
    from gpu_attention import check_attention

    return _kernel_part("attention", check_attention, device, smoke)


def moe_part(device: str, smoke: bool) -> int:
    """``--part moe``: benchmarks/gpu_moe.py (imported here: it needs triton)."""
    from gpu_moe import check_moe

    return _kernel_part("moe", check_moe, device, smoke)


def build_fp8(cfg: MiniMaxM2Config, state: dict[str, torch.Tensor], device: str,
              fp8_linear: str) -> MiniMaxM2ForCausalLM:
    """The bf16 model of ``state`` with every attention and expert linear quantised to FP8 blocks
    ON ``device`` and held as stored, then the per-module kernel choice (``fp8_linear`` mode)."""
    from m2serve.model.kernel_choice import choose_kernels

    model = build(cfg, {k: v for k, v in state.items()}, torch.bfloat16, device)
    I = cfg.intermediate_size
    for layer in model.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, proj)
            lin.load(proj, PackedFP8(*quantize_fp8_block(lin.weight.detach().float())))
        ex = layer.block_sparse_moe.experts
        w13, w2 = ex.w13.detach().float(), ex.w2.detach().float()
        for e in range(ex.num_local):
            for which, w in (("w1", w13[e, :I]), ("w3", w13[e, I:]), ("w2", w2[e])):
                ex.load_expert(ex.start + e, which, PackedFP8(*quantize_fp8_block(w)))
        ex.pack_for_kernels()
    choose_kernels(model, fp8_linear=fp8_linear)
    return model


def _time_call(fn, device: str, reps: int) -> float:
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def check_weights(device: str, smoke: bool) -> dict:
    """(w1)-(w3) of the module docstring (``smoke``: tiny dims, CPU, the kernel under Triton's
    interpreter)."""
    from m2serve.kernels.triton.fp8_linear import fp8_linear
    from m2serve.model.load import resident_weight_bytes

    out: dict = {"torch": torch.__version__, "device": device,
                 "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None}
    dims = TINY if smoke else BENCH
    H = dims["hidden_size"]
    Q = dims["num_attention_heads"] * dims["head_dim"]
    act = torch.float32 if smoke else torch.bfloat16  # the interpreter computes fp32 (docs/kernels.md §1)
    g = torch.Generator(device=device).manual_seed(0)
    lin = {}
    for name, (n, k) in {"q_proj": (Q, H), "o_proj": (H, Q)}.items():
        w = torch.randn(n, k, generator=g, device=device) / k ** 0.5
        q, s = quantize_fp8_block(w)
        w_ref = dequantize_fp8_block(q, s, torch.float32)
        w_bf16 = w_ref.to(torch.bfloat16)
        for m in ((1, 5) if smoke else (1, 32, 512)):
            x = torch.randn(m, k, generator=g, device=device).to(act)
            ref = x.float() @ w_ref.T
            xq, xs = quantize_fp8_act_groups(x.float())
            ref8 = (xq.float() * xs.repeat_interleave(128, 1)) @ w_ref.T
            row = {}
            for mode, r in (("w8a16", ref), ("w8a8", ref8)):
                y = fp8_linear(x, q, s, mode=mode).float()
                row[mode] = {"rel_vs_ref": float((y - r).abs().max() / r.abs().max()),
                             "rel_vs_fp32": float((y - ref).abs().max() / ref.abs().max())}
                if not smoke:
                    row[mode]["us"] = 1e6 * _time_call(
                        lambda x=x, q=q, s=s, mode=mode: fp8_linear(x, q, s, mode=mode), device, 20)
            if not smoke:
                row["bf16_F.linear_us"] = 1e6 * _time_call(
                    lambda x=x, w=w_bf16: torch.nn.functional.linear(x, w), device, 20)
            lin[f"{name}_m{m}"] = row
            print(f"[w1] {name} [{n}x{k}] m {m}: {row}")
        # a TP slice that splits a 128-wide band (docs/checkpoints.md §6; the expert shape 1536 / 8):
        # rows [192, 384) of q_proj (row0 64, scale rows 1..2), columns [192, 384) of o_proj (col0 64,
        # scale columns 1..2). W8A8's groups are the weight's bands: the reference quantises x padded
        # in front with col0 zero columns (zeros change no group's amax).
        x = torch.randn(1 if smoke else 32, k, generator=g, device=device).to(act)
        if name == "q_proj":
            row0, col0, xs_, qs, ss, w_sl = 64, 0, x, q[192:384], s[1:3], w_ref[192:384]
        else:
            row0, col0, xs_, qs, ss, w_sl = 0, 64, x[:, 192:384], q[:, 192:384], s[:, 1:3], w_ref[:, 192:384]
        padded = torch.nn.functional.pad(xs_.float(), (col0, -(col0 + xs_.shape[1]) % 128))
        xq, xsc = quantize_fp8_act_groups(padded)
        x8 = (xq.float() * xsc.repeat_interleave(128, 1))[:, col0:col0 + xs_.shape[1]]
        row = {}
        for mode, r in (("w8a16", xs_.float() @ w_sl.T), ("w8a8", x8 @ w_sl.T)):
            y = fp8_linear(xs_, qs, ss, row0=row0, col0=col0, mode=mode).float()
            row[mode] = {"rel_vs_ref": float((y - r).abs().max() / r.abs().max())}
        lin[f"{name}_split_band"] = row
        print(f"[w1] {name} TP slice that splits a band (row0 {row0}, col0 {col0}): {row}")
    out["fp8_linear"] = lin
    # W8A8 is judged on the GPU only: the interpreter's fp8 rounding is not the GPU's (docs/kernels.md §1)
    out["ok"] = all(v["w8a16"]["rel_vs_ref"] <= 1e-2 and (smoke or v["w8a8"]["rel_vs_ref"] <= 1e-2)
                    for v in lin.values())
    cfg = config(dims)
    with torch.device("meta"):
        shape_model = MiniMaxM2ForCausalLM(cfg)
    state = random_state(shape_model, seed=1)
    batches, steps = ((1,), 2) if smoke else ((1, 32), 20)
    dec = {}
    models = {"bf16": lambda: build(cfg, state, torch.bfloat16, device)}
    models.update({f"fp8_{mode}": (lambda mode=mode: build_fp8(cfg, state, device, mode))
                   for mode in ("w8a16", "w8a8")})
    for label, make in models.items():
        model = make()
        dec[label] = {f"decode_b{b}_tok_s": time_decode(model, cfg, b, torch.bfloat16, device, steps)
                      for b in batches}
        dec[label]["resident_gib"] = resident_weight_bytes(model) / 2**30
        summary = getattr(model, "kernel_summary", None)
        dec[label]["kernels"] = summary.banner() if summary is not None else "dense bf16 (no choice pass)"
        print(f"[w2] {label}: {dec[label]}")
        del model
    out["decode"] = dec
    out["load"] = load_synthetic_fp8(device, TINY if smoke else BENCH)
    print(f"[w3] {out['load']}")
    return out


def load_synthetic_fp8(device: str, dims: dict) -> dict:
    """(w3): write an FP8 checkpoint of ``dims`` and time ``load_model`` onto ``device``; counts
    the FP8 dequantisations that ran on the host during the load (0 expected)."""
    import tempfile

    from m2serve.formats import fp8 as fp8_mod
    try:
        from m2serve.checkpoints.tiny_random import build_tiny_random  # needs `tokenizers`
    except ImportError as exc:
        return {"skipped": f"cannot build a checkpoint here: {exc}"}
    from m2serve.model.load import load_model, resident_weight_bytes

    host = []
    real = fp8_mod.dequantize_fp8_block
    fp8_mod.dequantize_fp8_block = lambda q, *a, **k: host.append(q.device.type == "cpu") or real(q, *a, **k)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            path = build_tiny_random(os.path.join(tmp, "fp8"), variant="fp8",
                                     **{k: v for k, v in dims.items() if k != "max_position_embeddings"})
            built = time.perf_counter() - t
            sync(device)
            t = time.perf_counter()
            model = load_model(path, dtype=torch.bfloat16, device=device)
            sync(device)
            return {"build_s": built, "load_s": time.perf_counter() - t, "host_dequantisations": sum(host),
                    "resident_gib": resident_weight_bytes(model) / 2**30,
                    "kernels": model.kernel_summary.banner()}
    finally:
        fp8_mod.dequantize_fp8_block = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run the CPU-runnable parts on tiny dims")
    ap.add_argument("--part", choices=("model", "attention", "moe", "weights", "engine"), default="model",
                    help="model: the forward (this module's docstring); attention: the Triton paged "
                    "attention kernel (benchmarks/gpu_attention.py); moe: the Triton fused MoE "
                    "(benchmarks/gpu_moe.py); weights: (w1)-(w3), quantised weights kept as stored; "
                    "engine: decode steps with and without CUDA graphs against the bandwidth bound")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = "cuda"
    elif args.cpu_smoke:
        device = "cpu"
    else:
        print("gpu_check: no CUDA device visible; nothing to check here (use --cpu-smoke for the "
              "CPU-runnable parts)")
        return 0
    if args.part == "attention":
        return attention_part(device, smoke=args.cpu_smoke and device == "cpu")
    if args.part == "moe":
        return moe_part(device, smoke=args.cpu_smoke and device == "cpu")
    if args.part == "engine":
        return engine_part(device, smoke=args.cpu_smoke and device == "cpu")
    t = time.perf_counter()
    if args.part == "weights":
        out = check_weights(device, smoke=args.cpu_smoke and device == "cpu")
        ok = out["ok"]
    else:
        out = check(device, smoke=args.cpu_smoke and device == "cpu")
        ok = all(v["ok"] for k, r in out.items() if k.startswith("logits_") for v in r.values())
    out["wall_s"] = time.perf_counter() - t
    out["ok"] = ok
    if os.environ.get("OUT"):
        name = "gpu_check_weights.json" if args.part == "weights" else "gpu_check.json"
        path = os.path.join(os.environ["OUT"], name)
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {path}")
    print(f"gpu_check: {'OK' if ok else 'LOGITS OUT OF TOLERANCE'} in {out['wall_s']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
