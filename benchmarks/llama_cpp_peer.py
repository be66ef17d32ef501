"""llama.cpp side by side with m2serve on the bench config: decode tok/s at batch 1 and batched, through
the engine and the bare forward, effective GB/s, prefill; medians of alternating rounds.

The same random weights as ``benchmarks/formats.py`` (its bench config and checkpoints) run in both
engines, three pairs (``--formats`` picks), once per ``--threads`` count:

    m2serve bf16, kernels       (bf16 checkpoint, --weight-dequant load)      vs llama.cpp BF16
    m2serve FP8 packed          (fp8 checkpoint, --weight-dequant runtime)    vs llama.cpp Q8_0
    m2serve MXFP4 packed        (mxfp4 checkpoint, --weight-dequant runtime)  vs llama.cpp MXFP4_MOE

``--quantize-unquantized fp8`` loads the FP8 and MXFP4 rows with that flag (their bf16 attention
and lm_head quantised to FP8 blocks at load, docs/checkpoints.md §6).

The GGUFs are made from the bf16 checkpoint the way a user makes them: the converter shipped in the
llama-cpp-python sdist of the installed version (``vendor/llama.cpp/convert_hf_to_gguf.py``, its
``conversion/`` package and ``gguf-py``; the sdist is fetched with ``pip download`` unless
``--llama-src`` names an unpacked ``vendor/llama.cpp``, or the sdist is already in
``<cache>/llama-src/``) writes the BF16 GGUF, and ``llama_cpp.llama_model_quantize`` makes Q8_0 and
MXFP4_MOE from it. The converter refuses a tokenizer whose pre-tokenizer hash it does not know; the
bench tokenizer (trained by ``checkpoints/tokenizer_train.py``) is a byte-level BPE with the GPT-2
split regex, so the conversion subprocess replaces ``TextModel.get_vocab_base_pre`` in memory with
one that answers ``"gpt-2"`` (the vendored file is not edited). Token ids go in directly, so
tokenisation is not timed.

Measurement: per (threads, pair) one m2serve worker and one llama.cpp worker, each a subprocess that
loads once and stays up; the driver then alternates them, so that load drift on a shared machine
hits both alike. Per batch size B of ``--batch`` (default 1 and 16): one warm-up round, then
``--pairs`` rounds of [m2serve through ``LLMEngine.step`` | llama.cpp | m2serve bare forward], each
decoding B sequences of distinct 32-token prompts for ``--decode`` timed greedy steps (B tokens a
step). Printed: the median tok/s of each, and the median over rounds of the per-round ratios
m2serve / llama.cpp (engine and forward). Then the same for one ``--prefill``-token prompt.

- m2serve engine: ``LLMEngine`` as a server runs it (scheduler, paged KV cache of 16-token pages,
  prefix caching off so every round computes, sampler; greedy), the B requests added at once and
  prefilled in one step, the next ``--decode`` steps timed (each must return B tokens). Prefill: one
  request with max_tokens 1, add_request to its finished output.
- m2serve forward: the same loaded model called directly on a ``SimpleKVCache`` batch, argmax on the
  host each step (what the engine adds is the difference).
- llama.cpp: the C API through llama-cpp-python: one context with ``n_seq_max`` = the largest B,
  ``kv_unified`` off (each sequence its own KV range), ``n_batch = n_ubatch`` = max(prefill,
  B x 32), ``n_threads = n_threads_batch`` = threads; B sequences per ``llama_decode`` through one
  ``llama_batch`` (one token per sequence a step, logits of every row), argmax on the host.

llama.cpp quantises attention and lm_head too (Q8_0 in both quantised files), so it reads fewer
bytes per token than m2serve, whose releases keep them bf16 (unless ``--quantize-unquantized fp8``).
Both engines' bytes per batch-1 decode token follow one rule (``formats.decode_bytes``): every
weight except the embedding table, the experts at top-k / E of their bytes, as stored (GGUF tensor
sizes; m2serve's resident tensors). Effective GB/s (batch 1 only) = decode tok/s x bytes per token;
``x stream`` = that / the streaming read bandwidth measured in the same run (``formats.stream_gbs``).
Every table is stated with the CPU model, its ISA flags and the load average (``formats.machine_line``).

llama-cpp-python is an optional benchmark dependency (not in the test extras); it builds from
source in ~15 minutes on 2 cores:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip install llama-cpp-python==0.3.36
    python benchmarks/llama_cpp_peer.py [--threads 1 2] [--batch 1 16] [--decode 16] [--pairs 5]
        [--prefill 512] [--formats BF16 Q8_0 MXFP4_MOE] [--quantize-unquantized fp8] [--cache DIR]
        [--llama-src DIR]

On a CPU with AMX in a VM, such a ``-DGGML_NATIVE=ON`` build died with SIGILL in llama.cpp's AMX
kernels: in ``tinygemm_kernel_amx`` on a guest that did not enable AMX tiles, and in
``ggml_backend_amx_mul_mat`` (a ``tilezero``) on an Intel Xeon (Emerald Rapids) guest where they are
enabled (oneDNN's AMX kernels run there, and the tile permission request succeeds); the script then
says so and names the flags that leave AMX out (``NO_AMX``). A llama.cpp built apart
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
import statistics
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


# ---- persistent workers: one JSON request per stdin line, one RESULT line back ------------------

def decode_prompts(vocab: int, batch: int, round_: int) -> list[list[int]]:
    """``batch`` distinct ``formats.PROMPT``-token prompts for round ``round_`` (both engines)."""
    return [[(7919 * i + 13 + 101 * (round_ * batch + j)) % vocab for i in range(formats.PROMPT)]
            for j in range(batch)]


class M2Session:
    """m2serve in this process: one ``LLMEngine`` (as a server runs it) and, on the same loaded
    model, a bare forward over its own ``SimpleKVCache`` (no scheduler, no sampler)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from m2serve.config.engine_args import EngineArgs
        from m2serve.engine.core import LLMEngine
        from m2serve.kernels.build import kernel_backend
        from m2serve.model.simple_cache import SimpleKVCache

        self.torch = torch
        B, S, P, page = max(args.batch), args.decode, args.prefill, 16
        pages = B * -(-(formats.PROMPT + S + 2) // page) + -(-P // page) + 8
        t = time.perf_counter()
        self.eng = LLMEngine.from_args(EngineArgs(
            model=args.path, dtype="bfloat16", weight_dequant=args.mode, threads=args.threads,
            kv_cache_page_size=page, num_kv_pages=pages, max_batch_size=B, enable_prefix_caching=False,
            max_batch_input_tokens=max(P, B * formats.PROMPT),
            quantize_unquantized=args.quantize_unquantized))
        torch.set_num_threads(args.threads)
        self.load_s = time.perf_counter() - t
        self.model = self.eng.runner.model
        self.cache = SimpleKVCache.create(self.eng.config, num_pages=pages, page_size=page,
                                          dtype=torch.bfloat16)
        self.V = self.eng.config.vocab_size
        self.info = {"load_s": self.load_s, "weights_gib": formats.resident_bytes(self.model) / 2**30,
                     "bytes_per_token": formats.bytes_per_decode_token(self.model),
                     "backend": kernel_backend().name}

    def engine_decode(self, B: int, steps: int, r: int) -> dict:
        """B requests prefilled in one step, then ``steps`` timed ``LLMEngine.step`` calls (B tokens each)."""
        from m2serve.engine.sampling import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        for j, p in enumerate(decode_prompts(self.V, B, r)):
            self.eng.add_request(f"d{r}-{j}", p, params)
        first: set[str] = set()
        while len(first) < B:
            first.update(o.request_id for o in self.eng.step() if o.new_token_ids)
        n, t = 0, time.perf_counter()
        for _ in range(steps):
            n += sum(len(o.new_token_ids) for o in self.eng.step())
        s = time.perf_counter() - t
        while self.eng.has_unfinished_requests():
            self.eng.step()
        return {"s": s, "tokens": n}

    def forward_decode(self, B: int, steps: int, r: int) -> dict:
        """The same B prompts through the bare model forward, greedy argmax on the host each step."""
        seqs = [("f", r, j) for j in range(B)]
        with self.torch.inference_mode():
            batch = self.cache.batch(list(zip(seqs, decode_prompts(self.V, B, r))))
            logits = self.model(batch, self.cache.storage)
            toks = logits.argmax(-1).tolist()
            t = time.perf_counter()
            for _ in range(steps):
                batch = self.cache.batch([(q, [k]) for q, k in zip(seqs, toks)])
                logits = self.model(batch, self.cache.storage)
                toks = logits.argmax(-1).tolist()
            s = time.perf_counter() - t
        for q in seqs:
            self.cache.free(q)
        return {"s": s, "tokens": B * steps}

    def engine_prefill(self, P: int, r: int) -> dict:
        """One P-token request with max_tokens 1: add_request to its finished output (TTFT)."""
        from m2serve.engine.sampling import SamplingParams

        prompt = [(104729 * i + 7 + r) % self.V for i in range(P)]
        t = time.perf_counter()
        self.eng.add_request(f"p{r}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while self.eng.has_unfinished_requests():
            self.eng.step()
        return {"s": time.perf_counter() - t, "tokens": P}

    def forward_prefill(self, P: int, r: int) -> dict:
        prompt = [(104729 * i + 7 + r) % self.V for i in range(P)]
        with self.torch.inference_mode():
            t = time.perf_counter()
            self.model(self.cache.batch([(("p", r), prompt)]), self.cache.storage).argmax(-1).tolist()
            s = time.perf_counter() - t
        self.cache.free(("p", r))
        return {"s": s, "tokens": P}


class LlamaSession:
    """llama.cpp through llama-cpp-python's C API: one context with ``n_seq_max`` = the largest
    batch (``kv_unified`` off: each sequence its own KV range), B sequences per ``llama_decode``
    through one ``llama_batch``, greedy argmax of the B logits rows on the host each step."""

    def __init__(self, args: argparse.Namespace):
        import llama_cpp
        import numpy as np

        self.ll, self.np = llama_cpp, np
        B, S, P = max(args.batch), args.decode, args.prefill
        self.n_batch = max(P, B * formats.PROMPT)
        llama_cpp.llama_backend_init()
        t = time.perf_counter()
        self.model = llama_cpp.llama_model_load_from_file(args.path.encode(),
                                                          llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_seq_max, cp.kv_unified = B, False
        cp.n_ctx = B * max(P, formats.PROMPT + S + 8)  # split evenly over the B sequences
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_threads = cp.n_threads_batch = args.threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed for {args.path}")
        self.load_s = time.perf_counter() - t
        self.V = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, B)
        self.info = {"load_s": self.load_s, "weights_gib": llama_cpp.llama_model_size(self.model) / 2**30}

    def _decode(self, seqs: list[list[int]], start: int) -> list[int]:
        """Append seqs[j] to sequence j at positions start.. (one llama_decode); greedy next tokens."""
        b, i = self.batch, 0
        for j, toks in enumerate(seqs):
            for k, tok in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, start + k, 1, k == len(toks) - 1
                b.seq_id[i][0] = j
                i += 1
        b.n_tokens = i
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = self.np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(len(seqs), self.V))
        return logits.argmax(axis=1).tolist()

    def _clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def decode(self, B: int, steps: int, r: int) -> dict:
        self._clear()
        toks = self._decode(decode_prompts(self.V, B, r), 0)
        t = time.perf_counter()
        for s in range(steps):
            toks = self._decode([[k] for k in toks], formats.PROMPT + s)
        return {"s": time.perf_counter() - t, "tokens": B * steps}

    def prefill(self, P: int, r: int) -> dict:
        self._clear()
        prompt = [(104729 * i + 7 + r) % self.V for i in range(P)]
        t = time.perf_counter()
        self._decode([prompt], 0)
        return {"s": time.perf_counter() - t, "tokens": P}


def serve_worker(args: argparse.Namespace) -> None:
    """Load one engine (``--engine m2serve|llama``), print ``READY {info}``, then answer each stdin
    line ``{"op": ..., "batch"/"tokens": n, "steps": n, "round": r}`` with ``RESULT {...}``."""
    sess = M2Session(args) if args.engine == "m2serve" else LlamaSession(args)
    print("READY " + json.dumps(sess.info), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op, r = req["op"], req.get("round", 0)
        if op == "exit":
            print("RESULT " + json.dumps({"peak_rss_gib": formats.peak_rss_gib()}), flush=True)
            return
        if op == "decode":
            fn = sess.decode if args.engine == "llama" else getattr(sess, f"{req['via']}_decode")
            out = fn(req["batch"], req["steps"], r)
        else:
            fn = sess.prefill if args.engine == "llama" else getattr(sess, f"{req['via']}_prefill")
            out = fn(req["tokens"], r)
        print("RESULT " + json.dumps(out), flush=True)


class Worker:
    """Driver side of one serve_worker subprocess (stderr kept in a temp file for errors)."""

    def __init__(self, engine: str, path: Path, args: argparse.Namespace, threads: int, mode: str = "runtime",
                 quantize_unquantized: str = "none"):
        self.name = f"{engine} {path.name}"
        self.err = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, __file__, "--serve-worker", "--engine", engine, "--path", str(path),
               "--threads", str(threads), "--mode", mode, "--quantize-unquantized", quantize_unquantized,
               "--batch", *map(str, args.batch), "--decode", str(args.decode), "--prefill", str(args.prefill)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True)
        self.info = self._read("READY ")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        rc = self.proc.wait()
        self.err.seek(0)
        tail = self.err.read()[-3000:]
        if rc == -signal.SIGILL:
            raise RuntimeError(f"{self.name} died of an illegal instruction: seen with a llama.cpp build "
                               f"with AMX kernels in VMs (with and without AMX tiles enabled); rebuild "
                               f"llama-cpp-python without AMX: {NO_AMX} pip install --no-cache-dir "
                               f"--force-reinstall llama-cpp-python==0.3.36")
        raise RuntimeError(f"{self.name} exited with {rc}:\n{tail}")

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT ")

    def close(self) -> dict:
        """Ask the worker to exit; its peak RSS ({} when it already died)."""
        if self.proc.poll() is not None:
            return {"peak_rss_gib": float("nan")}
        out = self.ask(op="exit")
        self.proc.wait()
        return out


def median_pair_ratio(a: list[float], b: list[float]) -> float:
    """Median over pairs of a[i] / b[i] (tok/s of the two engines measured back to back)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def measure_pair(m2: Worker, ll: Worker, batches: list[int], steps: int, prefill: int, pairs: int) -> dict:
    """Alternating rounds m2serve engine, llama.cpp, m2serve forward (one warm-up round per batch
    size first): per batch size the tok/s of each round, then the same for prefill."""
    out: dict = {}
    for B in batches:
        m2.ask(op="decode", via="engine", batch=B, steps=2, round=99)
        ll.ask(op="decode", batch=B, steps=2, round=99)
        m2.ask(op="decode", via="forward", batch=B, steps=2, round=99)
        rows = {"engine": [], "llama": [], "forward": []}
        for r in range(pairs):
            for key, w, extra in (("engine", m2, {"via": "engine"}), ("llama", ll, {}),
                                  ("forward", m2, {"via": "forward"})):
                res = w.ask(op="decode", batch=B, steps=steps, round=r, **extra)
                if res["tokens"] != B * steps:
                    raise RuntimeError(f"{w.name}: {res['tokens']} tokens in {steps} steps at batch {B}")
                rows[key].append(res["tokens"] / res["s"])
        out[B] = rows
    rows = {"engine": [], "llama": [], "forward": []}
    for r in range(pairs + 1):  # round 0: warm-up
        for key, w, extra in (("engine", m2, {"via": "engine"}), ("llama", ll, {}),
                              ("forward", m2, {"via": "forward"})):
            res = w.ask(op="prefill", tokens=prefill, round=r, **extra)
            if r:
                rows[key].append(res["tokens"] / res["s"])
    out["prefill"] = rows
    return out


# ---- driver -------------------------------------------------------------------------------------

def print_pair(label: str, lfmt: str, m_info: dict, l_info: dict, res: dict, bw: float) -> None:
    """One pair's lines: load and memory, then per batch size the median tok/s of each engine and the
    median of the per-round ratios; effective GB/s (tok/s x bytes per batch-1 token) at batch 1."""
    med = statistics.median
    mb, lb = m_info["bytes_per_token"], l_info["bytes_per_token"]
    print(f"\n{label} ({m_info['backend']}) vs llama.cpp {lfmt} (m2serve / llama.cpp): load "
          f"{m_info['load_s']:.1f} / {l_info['load_s']:.1f} s, weights {m_info['weights_gib']:.2f} / "
          f"{l_info['weights_gib']:.2f} GiB, peak RSS {m_info['peak_rss_gib']:.2f} / "
          f"{l_info['peak_rss_gib']:.2f} GiB, MB per batch-1 token {mb / 1e6:.1f} / {lb / 1e6:.1f}")
    print(f"  {'batch':>5}{'engine tok/s':>13}{'forward tok/s':>14}{'llama tok/s':>12}{'engine/llama':>13}"
          f"{'fwd/llama':>10}   batch 1: GB/s m2 / ll, eff GB/s ratio, x stream m2 / ll")
    for B in (k for k in res if k != "prefill"):
        r = res[B]
        e, f, ll = med(r["engine"]), med(r["forward"]), med(r["llama"])
        pe, pf = median_pair_ratio(r["engine"], r["llama"]), median_pair_ratio(r["forward"], r["llama"])
        gbs = (f"{e * mb / 1e9:.1f} / {ll * lb / 1e9:.1f}, {pe * mb / lb:.2f}x, "
               f"{e * mb / 1e9 / bw:.2f} / {ll * lb / 1e9 / bw:.2f}") if B == 1 else ""
        print(f"  {B:5d}{e:13.2f}{f:14.2f}{ll:12.2f}{pe:12.2f}x{pf:9.2f}x   {gbs}")
    r = res["prefill"]
    print(f"  prefill tok/s: engine {med(r['engine']):.1f}, forward {med(r['forward']):.1f}, llama.cpp "
          f"{med(r['llama']):.1f}; engine/llama {median_pair_ratio(r['engine'], r['llama']):.2f}x, "
          f"fwd/llama {median_pair_ratio(r['forward'], r['llama']):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16],
                   help="decode batch sizes (sequences per step)")
    p.add_argument("--decode", type=int, default=16, help="timed decode steps per round")
    p.add_argument("--pairs", type=int, default=5, help="alternating m2serve / llama.cpp rounds per row")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--formats", nargs="+", default=[f for _, f in PAIRS], choices=[f for _, f in PAIRS],
                   help="llama.cpp file types of the pairs to run")
    p.add_argument("--quantize-unquantized", default="none", choices=("none", "fp8"),
                   help="m2serve's --quantize-unquantized for the FP8 and MXFP4 rows")
    p.add_argument("--cache", type=Path, help="keep the checkpoints, sdist and GGUFs here and reuse them")
    p.add_argument("--llama-src", type=Path, help="an unpacked llama-cpp-python sdist's vendor/llama.cpp")
    p.add_argument("--convert-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="runtime", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.convert_worker:
        convert_worker(args.llama_src, Path(args.path), Path(args.out))
        return
    if args.serve_worker:
        args.threads = args.threads[0]
        serve_worker(args)
        return
    version = llama_cpp_version()
    if version is None:
        print(f"llama_cpp_peer: skipped, llama-cpp-python is not installed (an optional benchmark "
              f"dependency; it builds from source in ~15 minutes: {INSTALL})")
        return
    root = args.cache or Path(tempfile.mkdtemp(prefix="m2serve-llama-peer-"))
    pairs = [(row, f) for row, f in PAIRS if f in args.formats]
    try:
        t = time.perf_counter()
        paths = formats.build_all(root, ("bf16", "fp8", "mxfp4"))
        converter = args.llama_src or fetch_converter(root, version)
        ggufs = build_ggufs(root, converter, paths["bf16"], max(args.threads))
        dims = formats.BENCH_DIMS
        llama_bytes = {t: formats.decode_bytes(gguf_tensors(g, converter), dims["num_experts_per_tok"],
                                                 dims["num_local_experts"]) for t, g in ggufs.items()}
        print(f"bench config in 3 encodings + 3 GGUFs (llama-cpp-python {version}) ready in "
              f"{time.perf_counter() - t:.0f} s; {args.pairs} alternating rounds of {args.decode} decode "
              f"steps per batch size {args.batch} ({formats.PROMPT}-token prompts), {args.prefill}-token "
              f"prefill; medians")
        print(formats.machine_line())
        for threads in args.threads:
            bw = formats.stream_gbs(threads)
            print(f"\n{threads} thread(s): streaming read {bw:.1f} GB/s | {formats.machine_line()}")
            for row, ftype in pairs:
                enc, mode, _ = row.split(":")
                quq = args.quantize_unquantized if enc != "bf16" else "none"
                m2 = Worker("m2serve", paths[enc], args, threads, mode, quq)
                try:
                    ll = Worker("llama", ggufs[ftype], args, threads)
                    try:
                        res = measure_pair(m2, ll, args.batch, args.decode, args.prefill, args.pairs)
                    finally:
                        ll.info.update(ll.close(), bytes_per_token=llama_bytes[ftype])
                finally:
                    m2.info.update(m2.close())
                label = f"{enc} {mode}" + (" +fp8" if quq == "fp8" else "")
                print_pair(label, ftype, m2.info, ll.info, res, bw)
            print(formats.machine_line())
    finally:
        if not args.cache:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
