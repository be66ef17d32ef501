"""The ``m2serve`` console script: ``serve``, ``generate`` and ``plan``.

Flags follow MAX (``--devices``, ``--data-parallel-degree``, ``--ep-size`` ...); where a vLLM flag means
the same, its name is an alias (``--max-model-len`` for ``--max-length``, ``--tool-call-parser``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--gpu-memory-utilization``, ``--block-size``), and
vLLM's ``--enable-auto-tool-choice`` and ``--trust-remote-code`` are accepted and change nothing. Every
option can
also come from the environment (``M2SERVE_<FLAG>``, e.g. ``M2SERVE_API_KEY``, ``M2SERVE_PORT``)
and from a recipe (``--config-file``, recipe.py). Precedence: CLI > environment > recipe >
defaults. With no model, ``serve`` and ``generate`` use the embedded default checkpoint.

Multi-node: start ``m2serve serve`` on every rank with torchrun (env:// rendezvous), e.g.
``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m m2serve.serve.cli serve
--devices gpu --ep-size 8 ...``; rank 0 hosts the HTTP server and the scheduler, the other ranks
run the model's steps until rank 0 stops.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import m2serve
from m2serve.config.engine_args import (
    ACTIVATION_QUANT_MODES,
    ATTENTION_BACKENDS,
    COMPUTE_DTYPES,
    DEFAULT_DTYPE,
    FP8_LINEAR_MODES,
    KV_CACHE_FORMATS,
    QUANTIZE_UNQUANTIZED_MODES,
    WEIGHT_DEQUANT_MODES,
    EngineArgError,
    EngineArgs,
)

log = logging.getLogger("m2serve")

ENV_PREFIX = "M2SERVE_"
# Seconds the streams ended at the grace deadline get to send their last events before uvicorn cancels.
SHUTDOWN_FLUSH_S = 5.0

# Server-level defaults (engine-level ones come from EngineArgs).
SERVE_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8000,
    "api_key": None,
    "max_queue_size": None,
    "max_request_bytes": 32 * 2**20,
    "thinking_signing_key": None,
    "tool_parser": "minimax_m2",
    "reasoning_parser": "minimax_m2",
    "thinking_temperature": None,
    "chat_template": None,
    "grace_period": 30.0,
    "exclude_tools_when_tool_choice_none": False,
    "log_level": "info",
}
GENERATE_DEFAULTS: dict[str, Any] = {
    "max_tokens": 64,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "sampling_seed": None,
    "chat": False,
    "prompts_file": None,
    "chat_template": None,
    "tool_parser": "minimax_m2",
    "reasoning_parser": "minimax_m2",
    "thinking_temperature": None,
    "log_level": "warning",
}
PLAN_DEFAULTS: dict[str, Any] = {"device_memory_gib": None, "log_level": "warning"}
# What an unset option (default None) means, for --help: every option shows its default.
UNSET_MEANING: dict[str, str] = {
    "config_file": "none",
    "model": "the embedded tiny-chat checkpoint",
    "max_length": "the config's max_position_embeddings, capped to the KV cache",
    "num_kv_pages": "the memory planner's count",
    "kv_cache_memory_gib": "min(4, what min(max-batch-size, 8) x max-length needs) on CPU",
    "served_model_name": "the --model value, else the checkpoint directory's name",
    "chat_template": "the checkpoint's chat_template.jinja",
    "thinking_temperature": "the request's temperature",
    "threads": "OMP_NUM_THREADS if set, else one per physical core; one per rank with cpu:N",
    "api_key": "none, no authentication",
    "thinking_signing_key": "random per process",
    "max_queue_size": "unbounded",
    "prompts": "a few built-in chat prompts, run as chats",
    "model_tag": "--model",
    "prompts_file": "none",
    "top_p": "the checkpoint's generation_config.json",
    "top_k": "the checkpoint's generation_config.json",
    "sampling_seed": "unseeded",
    "device_memory_gib": "measured free memory",
    "speculative_config": "off",
    "enable_auto_tool_choice": "off",
    "trust_remote_code": "off",
}
_ENGINE_FIELDS = {f.name for f in fields(EngineArgs)}
# vLLM flags with no m2serve flag of the same meaning (those with one are aliases): what to use
# instead, added to the "unrecognized arguments" usage error.
_TP_HINT = ("ranks are placed with --devices (gpu:0,1,2,3 for four GPUs, cpu:N on CPU), the experts split "
            "with --ep-size, attention replicated with --data-parallel-degree (docs/parallelism.md)")
_DP_HINT = "use --data-parallel-degree with --devices (docs/parallelism.md)"
VLLM_HINTS: dict[str, str] = {
    "--tensor-parallel-size": _TP_HINT,
    "-tp": _TP_HINT,
    "--data-parallel-size": _DP_HINT,
    "-dp": _DP_HINT,
    "--enable-expert-parallel": "use --ep-size N (the ranks the experts are split over)",
    "--kv-cache-dtype": "use --kv-cache-format {bfloat16,float32,float8_e4m3fn}",
    "--quantization": "the checkpoint's own format is read from its config.json; "
                      "--quantize-unquantized fp8 quantises its bf16 linears",
}


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def _auto_dtype(text: str) -> str:
    """``--dtype``: vLLM's ``auto`` is the default compute dtype (MiniMax-M2's bf16)."""
    return DEFAULT_DTYPE if text == "auto" else text


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by serve, generate and plan (MAX names)."""
    a = p.add_argument
    a("--config-file", help="recipe YAML with MAX keys (recipes/*.yaml)")
    a("--model", help="checkpoint directory or hub id")
    a("--devices", help="cpu | cpu:N (N CPU ranks) | gpu | gpu:0,1,...")
    a("--data-parallel-degree", type=int, help="attention data-parallel replicas (MAX's DP)")
    a("--ep-size", type=int, help="expert-parallel ranks the MoE experts are split over")
    a("--ep-use-allreduce", action=argparse.BooleanOptionalAction, default=None,
      help="combine the experts' outputs with one all-reduce instead of all-to-all")
    a("--max-batch-input-tokens", "--max-num-batched-tokens", type=int,
      help="tokens per step, prefill chunks and decodes together")
    a("--max-length", "--max-model-len", type=int, help="max context in tokens")
    a("--device-memory-utilization", "--gpu-memory-utilization", type=float,
      help="GPU: fraction of device memory the planner may use (weights, activations, KV pages)")
    a("--kv-cache-page-size", "--block-size", type=int, help="tokens per KV cache page")
    a("--kv-cache-format", choices=list(KV_CACHE_FORMATS), help="KV cache element format")
    a("--kv-cache-memory-gib", type=float,
      help="CPU: GiB of KV pages per rank")
    a("--weight-dequant", choices=list(WEIGHT_DEQUANT_MODES),
      help="quantised weights: dequantise at load, or keep them as stored and dequantise when used "
           "(runtime); auto picks runtime on a GPU and where the CPU kernels run")
    a("--attention-backend", choices=list(ATTENTION_BACKENDS),
      help="auto: triton on a GPU where Triton imports, else torch (docs/kernels.md §7)")
    a("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
      help="never capture CUDA graphs: decode steps run eagerly (docs/serving.md §6.3)")
    a("--fp8-linear", choices=list(FP8_LINEAR_MODES),
      help="GPU FP8 linears: bf16 activations (w8a16) or dynamic e4m3 activations (w8a8)")
    a("--activation-quant", choices=list(ACTIVATION_QUANT_MODES),
      help="auto: quantise quantised linears' inputs as the checkpoint declares (W4A4); none: W4A16")
    a("--quantize-unquantized", choices=list(QUANTIZE_UNQUANTIZED_MODES),
      help="fp8: quantise the linears the checkpoint leaves in bf16 (attention, lm_head) to FP8 "
           "blocks at load")
    a("--log-level", type=str.lower, choices=["debug", "info", "warning", "error"], help="logging level")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--served-model-name", help="the model name the APIs answer to and report")
    a("--dtype", type=_auto_dtype, choices=list(COMPUTE_DTYPES),
      help="compute dtype (auto, vLLM's spelling: the default)")
    a("--max-batch-size", "--max-num-seqs", type=int, help="max running requests")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="reuse the KV pages of a prompt prefix already computed")
    a("--num-kv-pages", type=int, help="override the planner's KV page count")
    a("--chat-template", help="a Jinja chat template file overriding the checkpoint's")
    a("--tool-parser", "--tool-call-parser", choices=["minimax_m2", "none"],
      help="how tool calls are read from the output")
    a("--enable-auto-tool-choice", action="store_true", default=None,
      help="accepted for vLLM command lines, changes nothing: a request with tools may always call them "
           "(tool_choice auto), and the tool parser reads the calls")
    a("--trust-remote-code", action="store_true", default=None,
      help="accepted for vLLM command lines, changes nothing: m2serve runs no code from a checkpoint")
    a("--strict-tool-format", action=argparse.BooleanOptionalAction, default=None,
      help="refuse to start when the chat template writes tool calls the tool parser cannot read")
    a("--reasoning-parser", choices=["minimax_m2", "minimax_m2_append_think", "none"],
      help="how reasoning is split from the answer (append_think: kept in the content)")
    a("--thinking-temperature", type=float, help="temperature while a chat reply is still reasoning")
    a("--threads", type=int, help="intra-op CPU threads per process")
    a("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
      help="seeded requests get the same tokens alone and in any batch, at a speed cost (CPU)")
    a("--speculative-config",
      help='speculative decoding as JSON, vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": 4, '
           '"prompt_lookup_min": 2, "prompt_lookup_max": 4}; same tokens as without (docs/serving.md §13); '
           'method eagle3 with "model": DIR or hub id runs an EAGLE-3 draft, one device '
           '(docs/serving.md §14)')


def _sub(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one line shows in ``m2serve --help`` and atop its own ``--help``."""
    return sub.add_parser(name, help=text, description=text, allow_abbrev=False)  # a prefix is a mistype


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree. Defaults are None so that unset flags fall through to env/recipe/defaults."""
    parser = argparse.ArgumentParser(prog="m2serve", description="MiniMax-M2 inference and serving",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"m2serve {m2serve.__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    s = _sub(sub, "serve", "HTTP server: OpenAI Chat Completions, Completions and Responses, Anthropic "
             "Messages")
    s.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the checkpoint, as --model (vLLM's `serve MODEL` shape)")
    _add_deployment_flags(s)
    _add_engine_flags(s)
    s.add_argument("--host", help="address to listen on")
    s.add_argument("--port", type=int, help="port to listen on (0 = any free port)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Anthropic "
                   "clients) on the API routes; /health, /version, /metrics stay open (also M2SERVE_API_KEY)")
    s.add_argument("--max-queue-size", type=int, help="max requests waiting for admission (beyond: 503)")
    s.add_argument("--grace-period", type=float, help="seconds in-flight requests get after SIGTERM")
    s.add_argument("--max-request-bytes", type=int, help="largest request body accepted (beyond: 413)")
    s.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction,
                   default=None, help="with tool_choice none, leave the tools out of the prompt too "
                   "(vLLM's flag; by default they are rendered and no call can be generated)")
    s.add_argument("--thinking-signing-key", help="key of thinking-block signatures and sealed reasoning "
                   "(/v1/messages, /v1/responses)")

    g = _sub(sub, "generate", "offline generation with a progress bar and a throughput summary")
    _add_deployment_flags(g)
    _add_engine_flags(g)
    g.add_argument("prompts", nargs="*", help="prompts")
    g.add_argument("--prompts-file", help="one prompt per line")
    g.add_argument("--max-tokens", type=int, help="most tokens generated per prompt")
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--top-p", type=float, help="nucleus sampling: smallest token set with this probability")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens (0 = all)")
    g.add_argument("--seed", type=int, dest="sampling_seed", metavar="SEED", help="sampling seed")
    g.add_argument(
        "--chat", action="store_true", default=None, help="wrap each prompt as a user chat message"
    )

    _sub(sub, "build-kernels", "build the packed-weight CPU kernels now (else: on first use)")
    pl = _sub(sub, "plan", "memory plan from config.json alone (no weights)")
    _add_deployment_flags(pl)
    pl.add_argument("--max-batch-size", "--max-num-seqs", type=int, help="max running requests")
    pl.add_argument("--device-memory-gib", type=float, help="plan for devices with this much memory")
    engine_defaults = {f.name: f.default for f in fields(EngineArgs)}
    for sp, defaults in ((s, SERVE_DEFAULTS), (g, GENERATE_DEFAULTS), (pl, PLAN_DEFAULTS)):
        _show_defaults(sp, {**engine_defaults, **defaults})
    return parser


def _show_defaults(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Append ``(default: X)`` to the help of every option: its value, or for an unset (None) one
    what unset means (``UNSET_MEANING``). The flags' own defaults stay None, so an unset flag still
    falls through to environment / recipe / defaults. ``%`` is escaped for argparse's formatting."""
    for act in p._actions:
        if act.help == argparse.SUPPRESS or act.dest == "help":
            continue
        value = defaults.get(act.dest)
        shown = UNSET_MEANING.get(act.dest, "none") if value is None else value
        help_text = (act.help or "").replace(" (default: the embedded default checkpoint)", "")
        act.help = f"{help_text} (default: {str(shown).replace('%', '%%')})".lstrip()


def resolve_options(
    ns: argparse.Namespace,
    parser: argparse.ArgumentParser | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Merge defaults < recipe < environment < CLI into one dict keyed by flag dest.

    Environment variables are ``M2SERVE_<DEST>`` (``M2SERVE_EP_SIZE=8``) and are converted with
    the flag's own type. Raises ValueError naming the variable for a bad value, RecipeError for a
    bad recipe.
    """
    from m2serve.serve.recipe import load_recipe, recipe_overrides

    environ = os.environ if environ is None else environ
    cli = {k: v for k, v in vars(ns).items() if v is not None and k not in ("command", "model_tag")}
    tag = getattr(ns, "model_tag", None)
    if tag is not None:   # serve MODEL: the --model of vLLM's command line shape
        if cli.get("model", tag) != tag:
            raise ValueError(f"the model is given twice ({tag!r} and --model {cli['model']!r}); give one")
        cli["model"] = tag
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    defaults.update(
        {"serve": SERVE_DEFAULTS, "generate": GENERATE_DEFAULTS, "plan": PLAN_DEFAULTS}[ns.command]
    )
    opts = {k: v for k, v in defaults.items()}
    config_file = cli.get("config_file") or environ.get(ENV_PREFIX + "CONFIG_FILE")
    if config_file:
        opts.update(recipe_overrides(load_recipe(config_file)))
    types = _flag_types(parser, ns.command) if parser is not None else {}
    aliases = _alias_env_names(parser, ns.command) if parser is not None else {}
    for dest in set(opts) | set(types):
        names = [ENV_PREFIX + dest.upper(), *aliases.get(dest, ())]   # the flag's own name first
        name = next((n for n in names if n in environ), None)
        if name is None or dest in ("prompts", "model_tag"):
            continue
        raw = environ[name]
        conv = types.get(dest, str)
        try:
            opts[dest] = conv(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}={raw!r}: {e}") from e
    opts.update(cli)
    return opts


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``serve``, ``generate``, ``plan``, ``build-kernels``)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _alias_env_names(parser: argparse.ArgumentParser, command: str) -> dict[str, list[str]]:
    """dest -> ``M2SERVE_<ALIAS>`` for each other long name of a flag (``--max-model-len`` ->
    ``M2SERVE_MAX_MODEL_LEN`` for ``max_length``)."""
    sub = _subparser(parser, command)
    out: dict[str, list[str]] = {}
    for act in sub._actions:
        for opt in act.option_strings:
            name = opt.lstrip("-").replace("-", "_").upper()
            if opt.startswith("--") and not opt.startswith("--no-") and name != act.dest.upper():
                out.setdefault(act.dest, []).append(ENV_PREFIX + name)
    return out


def _flag_types(parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    sub = _subparser(parser, command)
    out = {}
    for act in sub._actions:
        if isinstance(act, argparse.BooleanOptionalAction) or isinstance(act, argparse._StoreTrueAction):
            out[act.dest] = _bool
        elif act.dest != "help":
            out[act.dest] = _one_of(act.type or str, act.choices) if act.choices else act.type or str
    return out


def _one_of(conv: Any, choices: Any) -> Any:
    """``conv`` that also refuses a value outside the flag's ``choices`` (as argparse does for the
    flag itself), so that a bad environment value is an error naming the variable."""
    def check(text: str) -> Any:
        v = conv(text)
        if v not in choices:
            raise ValueError(f"invalid choice {v!r} (choose from {', '.join(map(str, choices))})")
        return v
    return check


def engine_args_from(opts: dict[str, Any]) -> dict[str, Any]:
    """The EngineArgs keyword arguments present in ``opts`` (model excluded: LLM resolves it)."""
    return {k: v for k, v in opts.items() if k in _ENGINE_FIELDS and k != "model"}


# ---------------------------------------------------------------------------------- serve


def torchrun_world_size(environ: dict[str, str] | None = None) -> int:
    """WORLD_SIZE when started by torchrun / env:// rendezvous (RANK set), else 1."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", "1")) if "RANK" in env else 1


def _join_torchrun(opts: dict[str, Any]) -> Any:
    """Join a torchrun deployment: rank 0 gets an engine around its DistributedModel; every other
    rank serves the model's steps until rank 0 stops, then gets None (rank 0 hosts the HTTP
    server and the scheduler, docs/parallelism.md)."""
    from m2serve.config.model_config import MiniMaxM2Config
    from m2serve.engine.core import LLMEngine
    from m2serve.parallel.deploy import join_torchrun
    from m2serve.serve.resolve import resolve_engine_args, resolve_model

    path = resolve_model(opts.get("model"))
    args = EngineArgs(model=str(path), **resolve_engine_args(engine_args_from(opts)))
    if os.environ.get("RANK") != "0":
        # torchrun signals every rank at once; a worker keeps serving steps so that rank 0 can
        # drain its in-flight requests, then stops the workers itself (a dead rank 0 ends the
        # workers through the collective timeout).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    model = join_torchrun(args)
    if model is None:
        return None
    device = "cpu" if args.devices.startswith("cpu") else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return LLMEngine.from_model(model, MiniMaxM2Config.from_pretrained(path), args, device=device)


def _make_llm(opts: dict[str, Any]) -> Any:
    """The LLM for serve/generate; None on a torchrun rank > 0 once rank 0 has stopped it."""
    from m2serve.serve.llm import LLM

    engine = None
    if torchrun_world_size() > 1:
        engine = _join_torchrun(opts)
        if engine is None:
            return None
    return LLM(
        opts.get("model"),
        chat_template=opts.get("chat_template"),
        tool_parser=opts["tool_parser"],
        reasoning_parser=opts["reasoning_parser"],
        thinking_temperature=opts.get("thinking_temperature"),
        engine=engine,
        **engine_args_from(opts),
    )


def banner(llm: Any, opts: dict[str, Any]) -> str:
    """The start-up banner: model, encoding, parallel mode, intra-op threads (read back from torch),
    KV pages, max context, the attention backend, whether decode replays CUDA graphs (or why not,
    docs/serving.md §6.3), the weights' mode and linear backend (model/load.py ``weights_banner``),
    with a model loaded in this process the implementation picked per module and the resident
    weight bytes, the activations' numerics (``numerics_banner``: W4A4 or not) and for ``serve`` the URL."""
    import torch

    from m2serve.config.parallel import select_parallelism_mode
    from m2serve.engine.planner import GiB, checkpoint_encoding, kv_pool_bytes, num_devices
    from m2serve.model.load import local_model, numerics_banner, resident_weight_bytes, weights_banner

    enc = checkpoint_encoding(llm.config).value
    world = max(num_devices(llm.args.devices), torchrun_world_size())
    mode = select_parallelism_mode(world, llm.args.data_parallel_degree, llm.args.ep_size)
    stats = llm.engine.stats
    pages = stats.replicas[0].kv_pages_total if stats.replicas else stats.kv_pages_total   # per replica
    dp = f" per replica x {len(stats.replicas)} replicas" if len(stats.replicas) > 1 else ""
    url = f" | http://{opts['host']}:{opts['port']}/v1" if "port" in opts else ""
    engine_model = getattr(getattr(llm.engine, "runner", None), "model", None)
    model = local_model(engine_model)  # rank 0's for a multi-rank model
    weights = weights_banner(llm.args, model)
    if getattr(model, "kernel_summary", None) is not None:  # loaded in this process: count what it holds
        rank = "" if model is engine_model else " on rank 0"
        weights += f" | resident weights {resident_weight_bytes(model) / GiB:.2f} GiB{rank}"
    attention = getattr(model, "attention_backend", llm.args.attention_backend)
    runner = getattr(llm.engine, "runner", None)
    graphs = getattr(runner, "graphs", None)
    off = getattr(runner, "graphs_off", "not enabled")
    cuda_graphs = (f"CUDA graphs: decode buckets {graphs.buckets[0]}..{graphs.buckets[-1]} "
                   f"({len(graphs.buckets)})" if graphs is not None and off is None
                   else f"CUDA graphs off ({off})")
    spec = getattr(llm.engine, "speculative", None)
    return (
        f"m2serve {llm.served_model_name} | model {llm.model_path} | encoding {enc} | "
        f"devices {llm.args.devices} {f'mode {mode.value}' if world > 1 else '(one rank)'} | "
        f"threads {torch.get_num_threads()} intra-op "
        f"({llm.threads.rule}) | KV {pages} pages x {stats.kv_page_size} tokens{dp} "
        f"({llm.args.kv_cache_format}, "
        f"{kv_pool_bytes(llm.config, llm.args, pages, world) / GiB:.2f} GiB) | "
        f"max context {llm.max_length} | attention {attention} | {cuda_graphs} | "
        f"speculative {spec.describe() if spec is not None else 'off'} | {weights} | "
        f"{numerics_banner(llm.args, llm.config)}{url}"
    )


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound (and listening) before anything slow happens, so a taken
    port fails in milliseconds and uvicorn serves on this very socket (no check-then-bind race).
    SO_REUSEADDR as uvicorn sets it (a port in TIME_WAIT is reusable; a listening one is not).
    Raises OSError "port N in use ..." for EADDRINUSE, other OSErrors (bad host, no permission) as
    they come."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} in use on {host}: stop the process that holds it or choose "
                          f"another --port") from e
        raise
    sock.set_inheritable(True)
    return sock


#: Entries oneDNN (and PyTorch's ideep wrapper) may cache per process; see bound_onednn_caches.
ONEDNN_CACHE_ENTRIES = "64"


def bound_onednn_caches(environ: dict[str, str] | os._Environ) -> None:
    """Default ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` (PyTorch's ideep cache)
    to ``ONEDNN_CACHE_ENTRIES`` unless the user set them; read by oneDNN on first use, so call this
    before any matmul.

    Each new matmul shape (chunk sizes, per-expert row counts) keeps a compiled oneDNN kernel in these
    caches, 1,024 entries each by default, so native memory grew with every new long prompt: the
    default model's engine, fed unique 1,089-token prompts 8 at a time, grew ~4.7 MB RSS per prompt
    (malloc'd bytes, not tensors); with 64 entries RSS stayed flat over 64 such prompts, as it does
    with oneDNN off."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        environ.setdefault(name, ONEDNN_CACHE_ENTRIES)


def run_server(opts: dict[str, Any], llm: Any = None) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 after a graceful shutdown.

    The listening socket is bound first (:func:`bind_listen_socket`; a taken port is an OSError
    before the model loads), then uvicorn serves on that socket while the model loads in a background
    thread: until it is ready ``/health`` answers 503 ``{"status": "loading"}`` and every other route
    503 in its API's shape (api.py ``build_loading_app``). A load that fails stops the server and is
    raised here (the CLI reports it, exit 2).
    ``llm``: an already built :class:`~m2serve.serve.llm.LLM` (None = build one from ``opts``).
    On SIGTERM uvicorn stops accepting connections and gives in-flight requests
    ``grace_period`` seconds; at that deadline every request still running ends in its API's shape
    (an error event, then ``[DONE]`` / ``message``'s or ``response.failed``'s terminal events; a 503
    when not streamed), with one log line each, and the process exits 0.
    Before anything runs, :func:`bound_onednn_caches` caps oneDNN's shape caches.
    """
    bound_onednn_caches(os.environ)
    import uvicorn

    from m2serve.serve.chat_pipeline import end_in_flight

    class GracefulServer(uvicorn.Server):
        """uvicorn's server; its graceful shutdown ends what still runs at the grace deadline
        (uvicorn itself would cancel the tasks: truncated bodies and a traceback each)."""

        async def shutdown(self, sockets: Any = None) -> None:
            grace = float(opts["grace_period"])
            if app.state.ctx is None:  # stopped while the model was loading: nothing in flight
                await super().shutdown(sockets)
                return
            timer = asyncio.get_running_loop().call_later(grace, end_in_flight, app.state.ctx, grace)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    from m2serve.serve.api import ServerSettings, build_loading_app
    from m2serve.serve.async_engine import AsyncEngine
    from m2serve.serve.metrics import ServerMetrics

    # Only the process that hosts HTTP binds: a torchrun rank > 0 never serves HTTP.
    if os.environ.get("RANK", "0") != "0":
        _make_llm(opts)  # a torchrun worker rank: serves steps until rank 0 shuts down
        return 0
    sock = bind_listen_socket(opts["host"], int(opts["port"]))
    opts = {**opts, "port": sock.getsockname()[1]}  # the real port when --port 0
    metrics = ServerMetrics()

    def load() -> tuple[AsyncEngine, ServerSettings]:
        """Runs while the server already answers (503 loading, api.py build_loading_app)."""
        log.info("loading model %s", opts.get("model") or "(the embedded default)")
        built = llm or _make_llm(opts)
        engine = AsyncEngine(built, metrics, opts.get("max_queue_size"))
        aliases = tuple(a for a in (opts.get("model"), str(built.model_path)) if a)
        settings = ServerSettings(
            served_model_name=built.served_model_name,
            api_key=opts.get("api_key"),
            model_aliases=aliases,
            max_request_bytes=int(opts["max_request_bytes"]),
            thinking_signing_key=opts.get("thinking_signing_key"),
            exclude_tools_when_tool_choice_none=bool(opts.get("exclude_tools_when_tool_choice_none")),
        )
        print(banner(built, opts), flush=True)
        return engine, settings

    def stop_on_load_error() -> None:
        server.should_exit = True

    app = build_loading_app(load, opts.get("api_key"), metrics, int(opts["max_request_bytes"]),
                            on_load_error=stop_on_load_error)
    config = uvicorn.Config(
        app,
        host=opts["host"],
        port=int(opts["port"]),
        log_level=opts["log_level"],
        # past the grace deadline, the ended streams get this long to send their last events
        timeout_graceful_shutdown=float(opts["grace_period"]) + SHUTDOWN_FLUSH_S,
        access_log=False,
    )
    server = GracefulServer(config)
    # uvicorn re-raises the captured signal after its graceful shutdown; with these handlers
    # that re-raise is a no-op and the process exits 0 instead of dying from the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if app.state.load_error is not None:  # reported like any start-up error (exit 2)
        raise app.state.load_error
    return 0


# ---------------------------------------------------------------------------------- generate

# With no prompts: chat prompts of kinds the embedded default (tiny-chat) answers reliably, run as
# chats. Not arithmetic: it was trained on one-digit sums only and gets even those wrong at times
# ("8 plus 6 is 13"); "What is 12 plus 30?" printed "12 plus 30 is 1." as the first demo a user saw.
_DEFAULT_CHAT_PROMPTS = ["Hello!", "Repeat after me: the sky is blue",
                         "Repeat after me: the cat sat on the mat"]


def run_generate(opts: dict[str, Any]) -> int:
    """Generate for each prompt (tqdm over requests), print the texts and a throughput summary."""
    from m2serve.engine.sampling import SamplingParams
    from m2serve.serve.llm import throughput_summary

    prompts = list(opts.get("prompts") or [])
    if opts.get("prompts_file"):
        try:
            with open(opts["prompts_file"], encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:  # missing, a directory, not UTF-8 text
            raise ValueError(f"--prompts-file {opts['prompts_file']}: cannot read it as a UTF-8 text file "
                             f"({e})") from e
    chat = bool(opts.get("chat"))
    if not prompts:
        prompts, chat = list(_DEFAULT_CHAT_PROMPTS), True
    params = SamplingParams(  # checked before the model loads: a bad value fails at once
        temperature=opts["temperature"],
        top_p=opts.get("top_p"),
        top_k=opts.get("top_k"),
        seed=opts.get("sampling_seed"),
        max_tokens=opts["max_tokens"],
    )
    llm = _make_llm(opts)
    if llm is None:  # a torchrun worker rank
        return 0
    print(banner(llm, opts), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
    else:
        results = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    for prompt, r in zip(prompts, results):
        o = r.outputs[0]
        print(f"--- {prompt!r} [{o.finish_reason}, {len(o.token_ids)} tokens]")
        if o.reasoning:
            print(f"[reasoning] {o.reasoning}")
        if chat:
            print(o.content or "")
            for c in o.tool_calls:
                print(f"[tool call] {c.name}({c.arguments})")
        else:
            print(o.text)
    print(throughput_summary(results, dt), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------- plan


def run_plan(opts: dict[str, Any]) -> int:
    """Print the memory plan for ``--model`` (dir, config.json or hub id) without loading weights."""
    from m2serve.config.model_config import MiniMaxM2Config
    from m2serve.engine.planner import format_plan, plan_memory
    from m2serve.serve.resolve import resolve_config, resolve_engine_args

    cfg_path = resolve_config(opts.get("model"))
    config = MiniMaxM2Config.from_pretrained(cfg_path)
    args = EngineArgs(model=str(cfg_path.parent),
                      **resolve_engine_args(engine_args_from(opts), config_only=True))   # no weights
    print(f"model: {opts.get('model') or 'embedded default'} ({cfg_path})")
    plan = plan_memory(config, args, device_memory_gib=opts.get("device_memory_gib"))
    print(format_plan(plan))
    return 0


def check_options(command: str, opts: dict[str, Any]) -> str | None:
    """The usage error for a server/sampling option no run can use (checked before the model loads),
    else None. Engine options are checked by EngineArgs' consumers (planner, engine)."""
    if command == "serve":
        if not 0 <= int(opts["port"]) <= 65535:
            return f"--port {opts['port']}: must be in [0, 65535] (0 = any free port)"
        if opts.get("api_key") is not None and not str(opts["api_key"]).strip():
            return "--api-key is empty, which would let every client in; give a key or leave it unset"
        if opts.get("max_queue_size") is not None and int(opts["max_queue_size"]) < 1:
            return f"--max-queue-size {opts['max_queue_size']}: must be >= 1 (or unset: unbounded)"
        if int(opts["max_request_bytes"]) < 1:
            return f"--max-request-bytes {opts['max_request_bytes']}: must be >= 1"
        if not float(opts["grace_period"]) >= 0:
            return f"--grace-period {opts['grace_period']}: must be >= 0 seconds"
    t = opts.get("thinking_temperature")
    if t is not None and not (math.isfinite(float(t)) and float(t) >= 0):
        return f"--thinking-temperature {t}: must be >= 0 (0 = greedy)"
    return None


def check_engine_options(command: str, opts: dict[str, Any]) -> str | None:
    """The usage error for an engine option no run can use, else None: every check of
    engine/planner.py ``check_engine_args`` against the checkpoint's config.json (read, no weights),
    and for serve/generate a ``--chat-template`` that is not a file; run before the port binds and
    before the model loads (docs/serving.md §12). The message starts with the flag at fault
    (``--max-batch-size: max_batch_size=0 must be ...``). A ``--model`` hub id whose config.json is
    neither cached nor shipped is left to the load (it may be downloaded); a path that does not exist
    is an error here. An EAGLE-3 draft named by hub id is resolved here (cache, else download) and
    is an error when that fails, after every flag check passed (a refused flag fetches nothing); its
    config.json is checked against the target's here too. Raises
    what reading config.json raises (ValueError/OSError: a runtime error)."""
    from m2serve.config.engine_args import parse_speculative_config, rank_devices
    from m2serve.config.model_config import MiniMaxM2Config
    from m2serve.engine.core import check_speculative_target
    from m2serve.engine.planner import check_engine_args
    from m2serve.serve.resolve import (
        ModelNotFoundError,
        looks_like_hub_id,
        resolve_config,
        resolve_engine_args,
    )

    template = opts.get("chat_template")
    if command != "plan" and template is not None and not os.path.isfile(template):
        return f"--chat-template {template}: no such file"
    try:
        cfg_path: Path | None = resolve_config(opts.get("model"))
    except ModelNotFoundError as e:
        if not looks_like_hub_id(str(opts.get("model"))):
            return str(e)
        cfg_path = None   # left to the load (it may be downloaded); the draft is still resolved below
    world = torchrun_world_size()
    if cfg_path is not None:
        config = MiniMaxM2Config.from_pretrained(cfg_path)
        try:   # the flags first: a draft's hub id is parsed here, not fetched
            check_engine_args(config, EngineArgs(model=str(cfg_path.parent), **engine_args_from(opts)),
                              world if world > 1 else None)
        except EngineArgError as e:
            return f"--{e.field.replace('_', '-')}: {e}"
    try:
        engine_args = resolve_engine_args(engine_args_from(opts),   # an EAGLE-3 draft's hub id
                                          config_only=command == "plan")
    except ModelNotFoundError as e:
        return f"--speculative-config: {e}"
    if cfg_path is None:
        return None
    args = EngineArgs(model=str(cfg_path.parent), **engine_args)
    try:   # an EAGLE-3 draft that does not fit the target, or on several ranks (its config.json only)
        check_speculative_target(parse_speculative_config(args.speculative_config), config,
                                 world if world > 1 else len(rank_devices(args.devices)))
    except ValueError as e:
        return f"--speculative-config: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``m2serve`` console script; returns the exit status.

    Usage errors (exit 2) print the usage of the subcommand they belong to: an unknown or
    mistyped flag of ``serve`` shows ``usage: m2serve serve ...``, not the top-level usage."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    command_parser = _subparser(parser, ns.command)
    if unknown:
        flags = dict.fromkeys(a.split("=")[0] for a in unknown)
        hints = "".join(f"; vLLM's {flag}: {VLLM_HINTS[flag]}" for flag in flags if flag in VLLM_HINTS)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")
    if ns.command == "build-kernels":
        from m2serve.kernels.build import build_kernels_main
        return build_kernels_main()
    try:
        opts = resolve_options(ns, parser)
    except ValueError as e:
        command_parser.error(str(e))
    problem = check_options(ns.command, opts)
    if problem:
        command_parser.error(problem)
    logging.basicConfig(
        level=opts["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        problem = check_engine_options(ns.command, opts)  # before the port binds, before any load
    except (ValueError, OSError) as e:  # config.json unreadable or not MiniMax-M2's
        print(f"m2serve {ns.command}: error: {e}", file=sys.stderr)
        return 2
    if problem:
        command_parser.error(problem)
    try:
        if ns.command == "serve":
            return run_server(opts)
        if ns.command == "generate":
            return run_generate(opts)
        return run_plan(opts)
    except (ValueError, RuntimeError, OSError, NotImplementedError) as e:
        print(f"m2serve {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
