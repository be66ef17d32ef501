"""llama.cpp side by side with m2serve on the bench config: bytes read per token, effective GB/s, tok/s.

The same random weights as ``benchmarks/formats.py`` (its bench config and checkpoints) run in both
engines, three pairs, each engine's row in its own subprocess, once per ``--threads`` count:

    m2serve bf16, kernels       (bf16 checkpoint, --weight-dequant load)      vs llama.cpp BF16
    m2serve FP8 packed          (fp8 checkpoint, --weight-dequant runtime)    vs llama.cpp Q8_0
    m2serve MXFP4 packed        (mxfp4 checkpoint, --weight-dequant runtime)  vs llama.cpp MXFP4_MOE

The GGUFs are made from the bf16 checkpoint the way a user makes them: the converter shipped in the
llama-cpp-python sdist of the installed version (``vendor/llama.cpp/convert_hf_to_gguf.py``, its
``conversion/`` package and ``gguf-py``; the sdist is fetched with ``pip download`` unless
``--llama-src`` names an unpacked ``vendor/llama.cpp``) writes the BF16 GGUF, and
``llama_cpp.llama_model_quantize`` makes Q8_0 and MXFP4_MOE from it. The converter refuses a
tokenizer whose pre-tokenizer hash it does not know; the bench tokenizer (trained by
``checkpoints/tokenizer_train.py``) is a byte-level BPE with the GPT-2 split regex, so the
conversion subprocess replaces ``TextModel.get_vocab_base_pre`` in memory with one that answers
``"gpt-2"`` (the vendored file is not edited). Token ids go in directly, so tokenisation is not timed.

llama.cpp rows: ``Llama(n_threads = n_threads_batch = threads, n_batch = n_ubatch = prefill)``, the
prompts of formats.py (``formats.prompts``): 32 prompt tokens, one warm-up step, ``--decode``
greedy batch-1 steps timed; then a warm-up ``--prefill``-token prompt and a timed one (KV cleared).
llama.cpp quantises attention and lm_head too (Q8_0 in both quantised files), so it reads fewer
bytes per token than m2serve, whose releases keep them bf16. Both engines' bytes per decode token
follow one rule (``formats.decode_bytes``): every weight except the embedding table, the experts
at top-k / E of their bytes, as stored (GGUF tensor sizes; m2serve's resident tensors). Effective
GB/s = decode tok/s x bytes per token; ``x stream`` = that / the streaming read bandwidth measured
in the same run (``formats.stream_gbs``). The ratio lines divide m2serve's figure by llama.cpp's.

llama-cpp-python is an optional benchmark dependency (not in the test extras); it builds from
source in ~15 minutes on 2 cores:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install llama-cpp-python==0.3.36
    python benchmarks/llama_cpp_peer.py [--threads 1 2] [--decode 8] [--prefill 512] [--cache DIR]
        [--llama-src DIR]

On a CPU with AMX in a VM that does not enable AMX tiles, such a ``-DGGML_NATIVE=ON`` build dies
with SIGILL in llama.cpp's AMX Q8_0 kernel (``tinygemm_kernel_amx``; seen on this machine); the
script then says so and names the flags that leave AMX out (``NO_AMX``). A llama.cpp built apart
(``cmake`` of the sdist's vendor/llama.cpp) is used through ``LLAMA_CPP_LIB_PATH=<dir of libllama.so>``.
Without llama-cpp-python it prints why and exits 0. The checkpoints (3 encodings) and GGUFs take
~9 GB; they are built in a temp dir and removed at the end unless ``--cache DIR`` keeps them (the
checkpoint layout is formats.py's, so ``formats.py --cache DIR`` reuses them too).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import formats  # noqa: E402  (benchmarks/formats.py: bench config, checkpoints, m2serve rows)

# (m2serve encoding:mode:backend row of formats.py, llama.cpp file type), compared pairwise
PAIRS = (("bf16:load:kernels", "BF16"), ("fp8:runtime:kernels", "Q8_0"),
         ("mxfp4:runtime:kernels", "MXFP4_MOE"))
QUANT_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "MXFP4_MOE": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"}
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install llama-cpp-python==0.3.36'
NO_AMX = ("CMAKE_ARGS=\"-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 "
          "-mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\"")
# the parts of the sdist's vendor/llama.cpp the converter runs from
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python version, None when it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return llama_cpp.__version__


# ---- GGUFs -------------------------------------------------------------------------------------

def fetch_converter(root: Path, version: str) -> Path:
    """``vendor/llama.cpp`` of the llama-cpp-python ``version`` sdist (converter parts only) under
    ``root``, fetched with ``pip download`` once. Raises CalledProcessError when pip cannot get it."""
    name = f"llama_cpp_python-{version}"
    dest = root / "llama-src" / name / "vendor" / "llama.cpp"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    sdist_dir = root / "llama-src"
    sdist = sdist_dir / f"{name}.tar.gz"
    if not sdist.is_file():
        print(f"fetching the llama-cpp-python {version} sdist for its GGUF converter", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(sdist_dir)], check=True,
                       stdout=subprocess.DEVNULL)
    prefix = f"{name}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(CONVERTER_PARTS)]
        tar.extractall(sdist_dir, members=members, filter="data")
    return dest


def convert_worker(converter: Path, src: Path, out: Path) -> None:
    """Run the vendored convert_hf_to_gguf.py (bf16 out) in this process with the pre-tokenizer
    check answered ``"gpt-2"`` (see the module docstring)."""
    sys.path[:0] = [str(converter / "gguf-py"), str(converter)]
    import conversion.base
    import convert_hf_to_gguf

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outfile", str(out), "--outtype", "bf16"]
    convert_hf_to_gguf.main()


def build_ggufs(root: Path, converter: Path, bf16_ckpt: Path, threads: int) -> dict[str, Path]:
    """BF16 / Q8_0 / MXFP4_MOE GGUFs of ``bf16_ckpt`` under ``root`` (reused when there)."""
    import llama_cpp

    paths = {t: root / f"bench-{t.lower()}.gguf" for t in ("BF16", *QUANT_FTYPES)}
    if not paths["BF16"].is_file():
        tmp = paths["BF16"].with_suffix(".tmp")
        done = subprocess.run([sys.executable, __file__, "--convert-worker", "--llama-src", str(converter),
                               "--path", str(bf16_ckpt), "--out", str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py from {converter} failed on {bf16_ckpt}:\n"
                               f"{done.stderr[-3000:]}")
        tmp.rename(paths["BF16"])
    for ftype, const in QUANT_FTYPES.items():
        if paths[ftype].is_file():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, const)
        params.nthread = threads
        tmp = paths[ftype].with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(paths["BF16"]).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {ftype} returned {rc}")
        tmp.rename(paths[ftype])
    return paths


def gguf_tensors(path: Path, converter: Path) -> list[tuple[str, int]]:
    """(name, stored bytes) of every tensor in the GGUF at ``path`` (the sdist's gguf-py reader)."""
    if str(converter / "gguf-py") not in sys.path:
        sys.path.insert(0, str(converter / "gguf-py"))
    from gguf import GGUFReader

    return [(t.name, int(t.n_bytes)) for t in GGUFReader(path).tensors]


# ---- one llama.cpp measurement (subprocess) ---------------------------------------------------

def llama_worker(args: argparse.Namespace) -> None:
    """Time llama.cpp decode and prefill on the GGUF ``args.path``; print one JSON record."""
    import llama_cpp
    import numpy as np

    P = args.prefill
    t = time.perf_counter()
    llm = llama_cpp.Llama(args.path, n_ctx=P + formats.PROMPT + args.decode + 8, n_batch=P, n_ubatch=P,
                          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - t
    V = llm.n_vocab()
    prompt, long_prompt = formats.prompts(V, P)

    def step(tokens: list[int]) -> list[int]:
        llm.eval(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(V,))  # [V] fp32
        return [int(logits.argmax())]

    tok = step(step(prompt))
    t = time.perf_counter()
    for _ in range(args.decode):
        tok = step(tok)
    decode_s = time.perf_counter() - t
    llm.reset()
    step(long_prompt)  # warm-up prefill
    llm.reset()
    t = time.perf_counter()
    step(long_prompt)
    prefill_s = time.perf_counter() - t
    print(json.dumps({"load_s": load_s, "weights_gib": llama_cpp.llama_model_size(llm.model) / 2**30,
                      "peak_rss_gib": formats.peak_rss_gib(), "decode_tok_s": args.decode / decode_s,
                      "prefill_tok_s": P / prefill_s}))


def run_llama_row(path: Path, *, threads: int, decode: int, prefill: int) -> dict:
    """One llama.cpp row measured in its own subprocess (``llama_worker``): its JSON record."""
    cmd = [sys.executable, __file__, "--llama-worker", "--path", str(path), "--threads", str(threads),
           "--decode", str(decode), "--prefill", str(prefill)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == -signal.SIGILL:
        raise RuntimeError(f"llama.cpp died of an illegal instruction on {path.name}: a build with AMX "
                           f"kernels on a machine that does not enable AMX tiles (seen in VMs); rebuild "
                           f"llama-cpp-python with {NO_AMX}")
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp row on {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- driver -------------------------------------------------------------------------------------

def print_table(bw: float, rows: list[tuple[str, str, dict]]) -> None:
    """One line per (engine, format) row, then the m2serve / llama.cpp ratios of each pair."""
    print(f"{'engine':10}{'format':28}{'load s':>7}{'weights GiB':>12}{'peak RSS':>9}{'MB/token':>9}"
          f"{'decode tok/s':>13}{'GB/s':>6}{'x stream':>9}{'prefill tok/s':>14}")
    for engine, fmt, r in rows:
        gbs = r["decode_tok_s"] * r["bytes_per_token"] / 1e9
        print(f"{engine:10}{fmt:28}{r['load_s']:7.1f}{r['weights_gib']:12.2f}{r['peak_rss_gib']:9.2f}"
              f"{r['bytes_per_token'] / 1e6:9.1f}{r['decode_tok_s']:13.2f}{gbs:6.1f}{gbs / bw:9.2f}"
              f"{r['prefill_tok_s']:14.1f}")
    print("m2serve / llama.cpp:")
    for (_, fmt, m), (_, lfmt, ll) in zip(rows[0::2], rows[1::2]):
        ratio = (m["decode_tok_s"] * m["bytes_per_token"]) / (ll["decode_tok_s"] * ll["bytes_per_token"])
        print(f"  {fmt} vs {lfmt}: effective GB/s {ratio:.2f}x, decode tok/s "
              f"{m['decode_tok_s'] / ll['decode_tok_s']:.2f}x, prefill tok/s "
              f"{m['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x, bytes/token "
              f"{m['bytes_per_token'] / ll['bytes_per_token']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--cache", type=Path, help="keep the checkpoints, sdist and GGUFs here and reuse them")
    p.add_argument("--llama-src", type=Path, help="an unpacked llama-cpp-python sdist's vendor/llama.cpp")
    p.add_argument("--convert-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.convert_worker:
        convert_worker(args.llama_src, Path(args.path), Path(args.out))
        return
    if args.llama_worker:
        args.threads = args.threads[0]
        llama_worker(args)
        return
    version = llama_cpp_version()
    if version is None:
        print(f"llama_cpp_peer: skipped, llama-cpp-python is not installed (an optional benchmark "
              f"dependency; it builds from source in ~15 minutes: {INSTALL})")
        return
    root = args.cache or Path(tempfile.mkdtemp(prefix="m2serve-llama-peer-"))
    try:
        t = time.perf_counter()
        paths = formats.build_all(root, ("bf16", "fp8", "mxfp4"))
        converter = args.llama_src or fetch_converter(root, version)
        ggufs = build_ggufs(root, converter, paths["bf16"], max(args.threads))
        dims = formats.BENCH_DIMS
        llama_bytes = {t: formats.decode_bytes(gguf_tensors(g, converter), dims["num_experts_per_tok"],
                                                 dims["num_local_experts"]) for t, g in ggufs.items()}
        print(f"bench config in 3 encodings + 3 GGUFs (llama-cpp-python {version}) ready in "
              f"{time.perf_counter() - t:.0f} s (batch-1 decode of {args.decode} steps, "
              f"{args.prefill}-token prefill, m2serve computing in bfloat16)")
        for threads in args.threads:
            bw = formats.stream_gbs(threads)
            print(f"\n{threads} thread(s): streaming read {bw:.1f} GB/s | {formats.machine_line()}")
            rows = []
            for row, ftype in PAIRS:
                enc, mode, backend = row.split(":")
                m = formats.run_row(paths[enc], mode, backend, dtype="bfloat16", threads=threads,
                                    decode=args.decode, prefill=args.prefill)
                ll = run_llama_row(ggufs[ftype], threads=threads, decode=args.decode, prefill=args.prefill)
                ll["bytes_per_token"] = llama_bytes[ftype]
                rows += [("m2serve", f"{enc} {mode} ({m['backend']})", m), ("llama.cpp", ftype, ll)]
            print_table(bw, rows)
            print(formats.machine_line())
    finally:
        if not args.cache:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
