"""Load time, resident memory and decode tokens/s of BF16 / FP8 / NVFP4 / MXFP4 checkpoints.

The bench config (vocab 32,000, hidden 3072, 48 heads, 8 KV heads, head_dim 128, rotary_dim 64,
intermediate 1536, 2 layers, 32 experts top-8) is built once in a temp dir in four encodings of
the same random weights: BF16 and FP8 (128x128 blocks) by ``checkpoints/tiny_random.py``; NVFP4
(ModelOpt names and config) and MXFP4 (Quark names and config) by quantising the BF16 experts
here with the docs/checkpoints.md §6 conventions (NVFP4: weight_scale_2 = amax / (6 * 448), e4m3
block scales per 16; MXFP4: E8M0 scale 2^(floor(log2 amax) - 2) per 32; nearest E2M1 code).
Attention, router, embeddings and lm_head stay BF16, as in the releases (docs/checkpoints.md §7).

Each row (encoding, --weight-dequant mode, CPU linear backend) runs in its own subprocess, one
after the other, once per thread count (``--threads``, default 1 and 2), so memory figures do not
mix: load seconds, resident weight memory (distinct torch storages of the parameters and buffers),
the worker's peak RSS (VmHWM), batch-1 decode tokens/s (32 prompt tokens, ``--decode`` greedy steps
after one warm-up step) and prefill tokens/s (one ``--prefill``-token prompt after a warm-up one).
``backend`` is ``kernels`` (m2serve/kernels: bf16 and FP8 linears computed from the stored codes)
or ``aten`` (``M2SERVE_CPU_ISA=none``: the previous dequantise + ``aten::mm`` path, the baseline).
``runtime`` keeps the quantised weights as stored (FP8: every FP8 linear; FP4: the experts).

Bytes read per decode token = every weight except the embedding table, with the experts counted
at top-k / E of their bytes, as held in memory (packed or dense). The decode bound is the streaming
read bandwidth (a ``sum`` over 1 GiB, measured here before each thread count's rows) divided by
those bytes. Ratios are against the ``bf16 load aten`` row of the same thread count.

    python benchmarks/formats.py [--dtype bfloat16] [--threads 1 2] [--decode 8] [--prefill 512] [--cache DIR]
        [--rows bf16:load:aten fp8:runtime:kernels ...]

The four checkpoints take 5.5 GB; they are built in a temp dir and removed at the end, unless
``--cache DIR`` names a directory where they are kept and reused by the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

BENCH_DIMS = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  rotary_dim=64, intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8,
                  num_hidden_layers=2, vocab_size=32000)
RUNS = ("bf16:load:aten", "bf16:load:kernels", "fp8:load:kernels", "fp8:runtime:kernels",
        "nvfp4:load:kernels", "nvfp4:runtime:kernels", "mxfp4:load:kernels", "mxfp4:runtime:kernels")
PROMPT = 32

MODELOPT_QUANT = {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "modelopt"},
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}},
    "ignore": ["lm_head", "model.layers.*.block_sparse_moe.gate", "model.layers.*.self_attn*"],
}
QUARK_QUANT = {
    "quant_method": "quark",
    "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                       "scale_format": "e8m0", "is_dynamic": False}},
    "exclude": ["lm_head", "*block_sparse_moe.gate*", "*self_attn*"],
}


# ---- building the four encodings ----------------------------------------------------------------

def _e2m1_codes(x):
    """fp32 values already divided by their block scale -> nearest E2M1 code (uint8, sign in bit 3)."""
    import torch

    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6
    mag = torch.bucketize(x.abs(), mids).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def _pack(codes):
    return codes[:, 0::2] | (codes[:, 1::2] << 4)  # column 2j in the low nibble (docs/checkpoints.md §5)


def quantize_nvfp4(w) -> dict:
    import torch

    n, k = w.shape
    ws2 = w.abs().max() / (6 * 448)
    blocks = w.view(n, k // 16, 16)
    ws = (blocks.abs().amax(-1) / (6 * ws2)).clamp(2**-9, 448).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(blocks / (ws.float() * ws2)[..., None]).view(n, k)
    return {"weight": _pack(codes), "weight_scale": ws, "weight_scale_2": ws2.reshape(()),
            "input_scale": torch.tensor(1.0)}


def quantize_mxfp4(w) -> dict:
    import torch

    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    e = (torch.floor(torch.log2(blocks.abs().amax(-1).clamp(min=2**-126))) - 2).clamp(-127, 127)
    codes = _e2m1_codes(blocks / torch.exp2(e)[..., None]).view(n, k)
    return {"weight": _pack(codes), "weight_scale": (e + 127).to(torch.uint8)}


def build_fp4(src: Path, out: Path, encoding: str) -> Path:
    """Copy ``src`` (BF16) to ``out`` with every expert linear quantised to ``encoding`` (kept if there)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "config.json").is_file():
        return out
    quant, q = (MODELOPT_QUANT, quantize_nvfp4) if encoding == "nvfp4" else (QUARK_QUANT, quantize_mxfp4)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if ".experts." in name:
                    prefix = name[: -len("weight")]
                    tensors.update({prefix + part: v for part, v in q(t.to(torch.float32)).items()})
                else:
                    tensors[name] = t
    save_file(tensors, tmp / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, tmp / f)
    tmp.rename(out)
    return out


def build_all(root: Path, encodings: tuple[str, ...] = ("bf16", "fp8", "nvfp4", "mxfp4")) -> dict[str, Path]:
    """The bench config in ``encodings`` under ``root`` (built once, reused when there); bf16 always."""
    from m2serve.checkpoints.tiny_random import build_tiny_random

    paths = {"bf16": build_tiny_random(root / "bf16", variant="bf16", **BENCH_DIMS)}
    if "fp8" in encodings:
        paths["fp8"] = build_tiny_random(root / "fp8", variant="fp8", **BENCH_DIMS)
    for enc in ("nvfp4", "mxfp4"):
        if enc in encodings:
            paths[enc] = build_fp4(paths["bf16"], root / enc, enc)
    return paths


# ---- one measurement (subprocess) ---------------------------------------------------------------

def resident_bytes(model) -> int:
    """Bytes of the distinct torch storages behind the model's parameters and buffers."""
    storages = {}
    for t in (*model.parameters(), *model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def decode_bytes(tensors: Iterable[tuple[str, int]], top_k: int, num_experts: int) -> int:
    """Weight bytes one batch-1 decode step reads, from (tensor name, bytes as held) pairs: every
    tensor but the embedding table (``embed_tokens``; GGUF ``token_embd``: one row is gathered),
    expert tensors (``.experts.``; GGUF ``*_exps``, not the router ``ffn_gate_inp``) at
    ``top_k / num_experts`` of their bytes."""
    total = 0.0
    for name, nbytes in tensors:
        if "embed_tokens" in name or name.startswith("token_embd"):
            continue
        total += nbytes * (top_k / num_experts if ".experts." in name or "_exps" in name else 1.0)
    return int(total)


def bytes_per_decode_token(model) -> int:
    """``decode_bytes`` of the model's parameters and buffers as held (packed or dense)."""
    cfg = model.config
    tensors = [(name, t.numel() * t.element_size())
               for name, t in (*model.named_parameters(), *model.named_buffers())]
    return decode_bytes(tensors, cfg.num_experts_per_tok, cfg.num_local_experts)


def stream_gbs(threads: int, reps: int = 5) -> float:
    """Streaming read bandwidth in GB/s with ``threads`` threads: best of ``reps`` sums over 1 GiB."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


#: ISA flags (``/proc/cpuinfo``) that decide which kernel paths run, in m2serve and in llama.cpp.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
             "avx512vbmi", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine_line() -> str:
    """What every benchmark figure is stated with: CPU model, the ISA flags of ``ISA_FLAGS`` it has,
    online CPUs and the 1/5/15-minute load average, e.g. ``CPU: Intel(R) Xeon(R) Processor | ISA:
    avx2 fma ... | 2 CPUs | load average 9.68 10.61 10.55`` (Linux ``/proc``; ``?`` elsewhere)."""
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "?"
    return f"CPU: {model} | ISA: {isa} | {os.cpu_count()} CPUs | load average {load}"


def prompts(vocab_size: int, prefill: int) -> tuple[list[int], list[int]]:
    """The decode prompt (``PROMPT`` token ids) and the ``prefill``-token prompt every row uses."""
    return ([(7919 * i + 13) % vocab_size for i in range(PROMPT)],
            [(104729 * i + 7) % vocab_size for i in range(prefill)])


def worker(args: argparse.Namespace) -> None:
    import torch

    from m2serve.kernels.build import kernel_backend
    from m2serve.model.load import load_model
    from m2serve.model.simple_cache import SimpleKVCache

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t = time.perf_counter()
    model = load_model(args.path, dtype=dtype, progress=False, weight_dequant=args.mode)
    load_s = time.perf_counter() - t
    V, P = model.config.vocab_size, args.prefill
    pages = 3 * (P + PROMPT + args.decode) // 16 + 8
    cache = SimpleKVCache.create(model.config, num_pages=pages, page_size=16, dtype=dtype)
    prompt, long_prompt = prompts(V, P)
    with torch.inference_mode():
        tok = model(cache.batch([(0, prompt)]), cache.storage).argmax(-1).tolist()
        tok = model(cache.batch([(0, tok)]), cache.storage).argmax(-1).tolist()
        t = time.perf_counter()
        for _ in range(args.decode):
            tok = model(cache.batch([(0, tok)]), cache.storage).argmax(-1).tolist()
        decode_s = time.perf_counter() - t
        model(cache.batch([(1, long_prompt)]), cache.storage)  # warm-up prefill
        t = time.perf_counter()
        model(cache.batch([(2, long_prompt)]), cache.storage)
        prefill_s = time.perf_counter() - t
    print(json.dumps({"load_s": load_s, "weights_gib": resident_bytes(model) / 2**30,
                      "peak_rss_gib": peak_rss_gib(), "decode_tok_s": args.decode / decode_s,
                      "prefill_tok_s": P / prefill_s, "bytes_per_token": bytes_per_decode_token(model),
                      "backend": kernel_backend().name}))


def run_row(path: Path, mode: str, backend: str, *, dtype: str, threads: int, decode: int,
            prefill: int) -> dict:
    """One row measured in its own subprocess (``worker``): its JSON record."""
    env = {**os.environ, "M2SERVE_CPU_ISA": "none" if backend == "aten" else ""}
    cmd = [sys.executable, __file__, "--worker", "--path", str(path), "--mode", mode, "--dtype", dtype,
           "--threads", str(threads), "--decode", str(decode), "--prefill", str(prefill)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--rows", nargs="+", default=list(RUNS), help="encoding:mode:backend rows to run")
    p.add_argument("--cache", type=Path, help="keep the built checkpoints here and reuse them")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="load", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    root = args.cache or Path(tempfile.mkdtemp(prefix="m2serve-formats-"))
    try:
        t = time.perf_counter()
        paths = build_all(root)
        print(f"4 encodings of the bench config ready in {time.perf_counter() - t:.0f} s (compute "
              f"{args.dtype}, batch-1 decode of {args.decode} steps, {args.prefill}-token prefill)")
        for threads in args.threads:
            bw = stream_gbs(threads)
            print(f"\n{threads} thread(s): streaming read {bw:.1f} GB/s")
            rows = []
            for row in args.rows:
                enc, mode, backend = row.split(":")
                rows.append((enc, mode, backend, run_row(paths[enc], mode, backend, dtype=args.dtype,
                                                         threads=threads, decode=args.decode,
                                                         prefill=args.prefill)))
            base = next((r for e, m, b, r in rows if (e, m, b) == ("bf16", "load", "aten")), rows[0][3])
            print(f"{'encoding':9}{'dequant':9}{'backend':13}{'load s':>7}{'weights GiB':>12}{'peak RSS':>9}"
                  f"{'MB/token':>9}{'decode tok/s':>13}{'bound':>7}{'x bound':>8}{'GB/s':>6}"
                  f"{'x aten bf16':>12}{'prefill tok/s':>14}{'x aten':>7}")
            for enc, mode, _, r in rows:
                bound = bw * 1e9 / r["bytes_per_token"]
                print(f"{enc:9}{mode:9}{r['backend']:13}{r['load_s']:7.1f}{r['weights_gib']:12.2f}"
                      f"{r['peak_rss_gib']:9.2f}{r['bytes_per_token'] / 1e6:9.1f}{r['decode_tok_s']:13.2f}"
                      f"{bound:7.1f}{bound / r['decode_tok_s']:8.2f}"
                      f"{r['decode_tok_s'] * r['bytes_per_token'] / 1e9:6.1f}"
                      f"{r['decode_tok_s'] / base['decode_tok_s']:12.2f}{r['prefill_tok_s']:14.1f}"
                      f"{r['prefill_tok_s'] / base['prefill_tok_s']:7.2f}")
    finally:
        if not args.cache:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
