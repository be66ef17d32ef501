"""``m2serve generate`` and model resolution (issue 5 items 4–5, issue 4 item 6).

The hub-id tests use a fake local Hugging Face cache (``HF_HUB_CACHE`` with the hub's
``models--org--name/snapshots/<rev>`` + ``refs/main`` layout) and ``HF_HUB_OFFLINE=1``: no network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from m2serve.serve.resolve import (
    HUB_CONFIGS,
    ModelNotFoundError,
    looks_like_hub_id,
    resolve_config,
    resolve_model,
)

EXE = str(Path(sys.executable).with_name("m2serve"))


@pytest.fixture(scope="module")
def hf_cache(tiny_random_dir, tmp_path_factory):
    """A fake HF cache holding tiny-random as test-org/tiny (files linked, not copied)."""
    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / "models--test-org--tiny"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for f in Path(tiny_random_dir).iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    return root, snap


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "M2SERVE_"))}
    full.update({"OMP_NUM_THREADS": "1", **env})
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=300, env=full)


@pytest.mark.slow  # runs m2serve generate in a subprocess
def test_generate_hub_id_from_offline_cache(hf_cache):
    # issue 5 item 4: a hub id resolves through the HF cache with no network; `m2serve generate` (greedy)
    root, snap = hf_cache
    r = _run(
        [
            "generate",
            "--model",
            "test-org/tiny",
            "--max-tokens",
            "4",
            "--dtype",
            "float32",
            "--num-kv-pages",
            "64",
            "--kv-cache-page-size",
            "16",
            "Hello",
            "World",
        ],
        {"HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "--- 'Hello' [length, 4 tokens]" in r.stdout and "--- 'World' [length, 4 tokens]" in r.stdout
    assert "2 requests in" in r.stderr and "output tok/s" in r.stderr  # throughput summary
    assert "requests" in r.stderr  # the tqdm bar over requests


@pytest.mark.slow  # runs m2serve generate in a subprocess
def test_missing_hub_id_offline_is_a_clear_error(hf_cache):
    root, _ = hf_cache
    r = _run(
        ["generate", "--model", "test-org/absent", "hi"], {"HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}
    )
    assert r.returncode == 2
    assert "test-org/absent" in r.stderr and "HF_HUB_OFFLINE" in r.stderr


@pytest.mark.slow  # runs m2serve generate in a subprocess
def test_generate_embedded_default_without_model(tmp_path):
    # README quick start: `m2serve generate "prompt"` with the embedded default (the shipped tiny-chat,
    # issue 6) and no download or build: an empty cache directory stays empty
    r = _run(
        ["generate", "--max-tokens", "3", "--chat", "Hi there"],
        {"M2SERVE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert not any(tmp_path.iterdir())
    assert r.returncode == 0, r.stderr
    assert "--- 'Hi there'" in r.stdout and "1 requests in" in r.stderr


@pytest.mark.slow  # runs m2serve generate in a subprocess
def test_generate_checks_sampling_flags_before_loading():
    # a bad sampling flag is refused before the model loads (it used to load the model and print the
    # banner first): exit 2, the message, no banner
    message = "invalid sampling parameter temperature=-1.0: must be >= 0"
    r = _run(["generate", "--temperature", "-1", "hi"], {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and f"m2serve generate: error: {message}" in r.stderr, r.stderr
    assert "m2serve tiny-chat |" not in r.stderr and "requests in" not in r.stderr


@pytest.mark.slow  # runs m2serve generate in a subprocess
def test_generate_without_prompts_runs_builtin_chats():
    # with no prompts, `m2serve generate` runs built-in chat prompts as chats (the embedded default is a
    # chat model: raw completion prompts only gave it noise): each reply is parsed into reasoning
    from m2serve.serve.cli import _DEFAULT_CHAT_PROMPTS

    r = _run(["generate", "--max-tokens", "64"], {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    for p in _DEFAULT_CHAT_PROMPTS:
        assert f"--- {p!r} [stop," in r.stdout, r.stdout  # each demo reply ends within its budget
    # the demo shows replies that are right: a copy prompt prints its phrase back as the answer line
    # (a built-in "What is 12 plus 30?" printed "12 plus 30 is 1.")
    copies = [p.removeprefix("Repeat after me: ") for p in _DEFAULT_CHAT_PROMPTS if p.startswith("Repeat")]
    assert copies
    answers = r.stdout.splitlines()
    for phrase in copies:
        assert phrase in answers, (phrase, r.stdout)
    for p in _DEFAULT_CHAT_PROMPTS:  # an arithmetic demo prompt must print the right value
        if m := re.fullmatch(r"What is (\d+) (plus|minus) (\d+)\?", p):
            a, b = int(m[1]), int(m[3])
            value = a + b if m[2] == "plus" else a - b
            assert f"{a} {m[2]} {b} is {value}." in answers, (p, r.stdout)
    assert r.stdout.count("[reasoning] ") == len(_DEFAULT_CHAT_PROMPTS)
    assert f"{len(_DEFAULT_CHAT_PROMPTS)} requests in" in r.stderr


def test_resolve_local_and_shipped(tiny_random_dir, tmp_path):
    assert resolve_model(str(tiny_random_dir)) == Path(tiny_random_dir)
    assert resolve_config(str(tiny_random_dir)) == Path(tiny_random_dir) / "config.json"
    assert resolve_config("MiniMaxAI/MiniMax-M2.7") == HUB_CONFIGS / "MiniMaxAI/MiniMax-M2.7/config.json"
    assert (
        looks_like_hub_id("org/name")
        and not looks_like_hub_id("./org/name")
        and not looks_like_hub_id("a/b/c")
    )
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "missing" / "dir"))
    # the shipped checkpoints by the names the API gives them (`m2serve serve tiny-chat`)
    shipped = Path(__file__).resolve().parents[2] / "src" / "m2serve" / "checkpoints"
    assert resolve_model("tiny-chat") == shipped / "tiny-chat" == resolve_model(None)
    assert resolve_config("tiny-chat") == shipped / "tiny-chat" / "config.json"
    assert resolve_model("tiny-chat-eagle3") == shipped / "tiny-chat-eagle3"
    local = tmp_path / "tiny-chat"   # a local directory of that name wins
    local.mkdir()
    cwd = Path.cwd()
    try:
        os.chdir(tmp_path)
        assert resolve_model("tiny-chat") == Path("tiny-chat")
    finally:
        os.chdir(cwd)
    with pytest.raises(ModelNotFoundError, match="MiniMaxAI/MiniMax-M2.7"):  # names the shipped ids
        resolve_config("nobody/nothing-" + tmp_path.name)


@pytest.mark.parametrize("argv, message", [
    (["--port", "-5"], "--port -5: must be in [0, 65535]"),  # was an OverflowError traceback at bind
    (["--port", "99999"], "--port 99999: must be in [0, 65535]"),
    (["--api-key", ""], "--api-key is empty"),  # "" silently let every client in
    (["--max-queue-size", "0"], "--max-queue-size 0: must be >= 1"),  # every request was a 503
    (["--grace-period", "-1"], "--grace-period -1.0: must be >= 0"),
    (["--max-request-bytes", "0"], "--max-request-bytes 0: must be >= 1"),
    (["--thinking-temperature", "-1"], "--thinking-temperature -1.0: must be >= 0"),  # every chat was a 500
])
def test_unusable_server_options_are_usage_errors(argv, message, capsys, monkeypatch):
    # adversarial: option values no server can use are a one-line usage error (exit 2) before any model
    # is loaded, not a traceback, a server without auth or a server failing every request
    from m2serve.serve.cli import main

    for var in ("PORT", "API_KEY", "MAX_QUEUE_SIZE", "GRACE_PERIOD", "THINKING_TEMPERATURE",
                "MAX_REQUEST_BYTES"):
        monkeypatch.delenv(f"M2SERVE_{var}", raising=False)
    monkeypatch.setattr("m2serve.serve.cli._make_llm", lambda opts: pytest.fail("model loaded first"))
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_shows_the_effective_defaults(capsys):
    # --help states the default each unset flag falls back to (EngineArgs and the command's own table),
    # while the parsed flags stay None so environment and recipe values still apply
    from m2serve.config.engine_args import EngineArgs
    from m2serve.serve.cli import SERVE_DEFAULTS, build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())  # argparse wraps lines
    engine = EngineArgs()
    for flag, value in [("--max-batch-input-tokens", engine.max_batch_input_tokens),
                        ("--kv-cache-format", engine.kv_cache_format),
                        ("--port", SERVE_DEFAULTS["port"]),
                        ("--max-request-bytes", SERVE_DEFAULTS["max_request_bytes"])]:
        after = text.split(flag, 1)[1]
        after = re.sub(r"^ [A-Z_]+(, --[a-z-]+ [A-Z_]+)*", "", after).split(" --", 1)[0]   # vLLM aliases
        assert f"(default: {value})" in after, (flag, after)
    assert parser.parse_args(["serve"]).port is None


def test_vllm_flag_names_are_aliases_of_the_max_flags():
    # the flags of vLLM's MiniMax-M2 recipe that have an m2serve equivalent: each vLLM name sets the
    # MAX flag of the same meaning, and --enable-auto-tool-choice / --trust-remote-code are accepted
    from m2serve.serve.cli import build_parser, resolve_options

    parser = build_parser()
    vllm = ["serve", "MiniMaxAI/MiniMax-M2", "--max-model-len", "512", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "256",
            "--gpu-memory-utilization", "0.8", "--block-size", "16", "--tool-call-parser", "minimax_m2",
            "--reasoning-parser", "minimax_m2_append_think", "--enable-auto-tool-choice",
            "--trust-remote-code", "--dtype", "auto"]
    opts = resolve_options(parser.parse_args(vllm), parser, {})
    assert opts["model"] == "MiniMaxAI/MiniMax-M2"   # `serve MODEL`, vLLM's shape
    assert {k: opts[k] for k in ("max_length", "max_batch_size", "max_batch_input_tokens",
                                 "device_memory_utilization", "kv_cache_page_size", "tool_parser",
                                 "reasoning_parser")} == {
        "max_length": 512, "max_batch_size": 4, "max_batch_input_tokens": 256,
        "device_memory_utilization": 0.8, "kv_cache_page_size": 16, "tool_parser": "minimax_m2",
        "reasoning_parser": "minimax_m2_append_think"}
    assert opts["dtype"] == "bfloat16"   # vLLM's --dtype auto: the default
    plan = resolve_options(parser.parse_args(["plan", "--max-num-seqs", "3"]), parser, {})
    assert plan["max_batch_size"] == 3
    # the environment under either name (M2SERVE_<FLAG>), the flag's own name first
    env = resolve_options(parser.parse_args(["serve"]), parser, {"M2SERVE_MAX_MODEL_LEN": "999",
                                                                 "M2SERVE_TOOL_CALL_PARSER": "none"})
    assert (env["max_length"], env["tool_parser"]) == (999, "none")
    both = resolve_options(parser.parse_args(["serve"]), parser, {"M2SERVE_MAX_MODEL_LEN": "999",
                                                                  "M2SERVE_MAX_LENGTH": "777"})
    assert both["max_length"] == 777
    with pytest.raises(ValueError, match="M2SERVE_MAX_NUM_SEQS='x'"):
        resolve_options(parser.parse_args(["serve"]), parser, {"M2SERVE_MAX_NUM_SEQS": "x"})
    with pytest.raises(SystemExit):   # the alias keeps the flag's choices
        parser.parse_args(["serve", "--tool-call-parser", "hermes"])


@pytest.mark.parametrize("argv, hint", [
    (["serve", "--tensor-parallel-size", "4"],
     "vLLM's --tensor-parallel-size: ranks are placed with --devices"),
    (["generate", "--kv-cache-dtype=fp8"], "vLLM's --kv-cache-dtype: use --kv-cache-format"),
    (["serve", "-dp", "2", "--enable-expert-parallel"], "vLLM's --enable-expert-parallel: use --ep-size N"),
])
def test_a_vllm_flag_without_an_alias_says_what_to_use(argv, hint, capsys):
    from m2serve.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"m2serve {argv[0]}: error: unrecognized arguments: " in err
    assert hint in err


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_unreadable_prompts_file_is_a_one_line_error(kind, tmp_path, capsys, monkeypatch):
    # adversarial: --prompts-file that is missing, a directory or not UTF-8 is exit 2 with a line naming
    # the flag and the file (a directory was an IsADirectoryError traceback); checked before any load
    from m2serve.serve.cli import main

    path = {"missing": tmp_path / "nope.txt", "directory": tmp_path, "binary": tmp_path / "b.txt"}[kind]
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00")
    monkeypatch.setattr("m2serve.serve.cli._make_llm", lambda opts: pytest.fail("model loaded first"))
    assert main(["generate", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--prompts-file {path}: cannot read it as a UTF-8 text file" in err and "Traceback" not in err


BAD_ENGINE_VALUES = [  # (argv, environment, the error line after "m2serve serve: error: ")
    (["--max-batch-size", "0"], {}, "--max-batch-size: max_batch_size=0 must be a positive integer"),
    ([], {"M2SERVE_MAX_BATCH_SIZE": "-3"}, "--max-batch-size: max_batch_size=-3 must be a positive"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}'], {},
     "--speculative-config: speculative_config.lookahead: unknown key"),
    # tiny-chat has 8 attention heads: 3 tensor-parallel CPU ranks cannot split them (rule V3)
    (["--devices", "cpu:3"], {}, "--devices: Number of attention heads (8) must be divisible by the tensor "
     "parallel degree (3)"),
    (["--devices", "cpu:2", "--data-parallel-degree", "3"], {},
     "--data-parallel-degree: data_parallel_degree=3 must be 1 or the number of devices (2)"),
    (["--kv-cache-page-size", "0"], {}, "--kv-cache-page-size: kv_cache_page_size=0 must be positive"),
    (["--num-kv-pages", "2", "--kv-cache-page-size", "16", "--max-length", "40"], {},
     "--max-length: max_length=40 does not fit in the KV cache: 2 pages x 16 tokens = 32 tokens"),
    (["--threads", "0"], {}, "--threads: threads=0 must be >= 1"),
    (["--kv-cache-memory-gib", "0"], {}, "--kv-cache-memory-gib: kv_cache_memory_gib=0.0 must be a positive"),
    ([], {"M2SERVE_KV_CACHE_FORMAT": "fp9"}, "M2SERVE_KV_CACHE_FORMAT='fp9': invalid choice 'fp9'"),
    (["--chat-template", "/nonexistent/template.jinja"], {},
     "--chat-template /nonexistent/template.jinja: no such file"),
]


@pytest.mark.parametrize("argv, env, message", BAD_ENGINE_VALUES)
def test_bad_engine_values_are_usage_errors_before_the_port_binds(argv, env, message, capsys, monkeypatch):
    # docs/serving.md §12: an engine value no run can use (from a flag or the environment) is refused with
    # the subcommand's usage and the flag at fault, exit 2, before the listening socket binds and before
    # the model loads (these used to bind the port, log "loading model", then fail in the load thread)
    from m2serve.serve.cli import main

    for var in [k for k in os.environ if k.startswith("M2SERVE_")]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("m2serve.serve.cli.bind_listen_socket", lambda *a: pytest.fail("port bound first"))
    monkeypatch.setattr("m2serve.serve.cli._make_llm", lambda opts: pytest.fail("model loaded first"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: m2serve serve"), err
    assert f"m2serve serve: error: {message}" in err and "Traceback" not in err, err


def test_a_refused_flag_fetches_no_draft_model(capsys, monkeypatch):
    # an EAGLE-3 draft named by hub id is resolved (a download when online) only after every flag check
    # passed: a bad --max-batch-size beside it is refused without touching the hub
    from m2serve.serve.cli import main

    for var in [k for k in os.environ if k.startswith("M2SERVE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr("m2serve.serve.resolve.resolve_model",
                        lambda *a, **k: pytest.fail("draft resolved before the flag checks"))
    monkeypatch.setattr("m2serve.serve.cli.bind_listen_socket", lambda *a: pytest.fail("port bound first"))
    spec = '{"method": "eagle3", "num_speculative_tokens": 2, "model": "some-org/some-draft"}'
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--max-batch-size", "0", "--speculative-config", spec])
    assert e.value.code == 2
    assert "m2serve serve: error: --max-batch-size: max_batch_size=0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--devices", "cpu:3", "hi"], "--devices: Number of attention heads (8) must be divisible"),
    (["generate", "--devices", "cpu:2", "--ep-size", "4", "hi"],
     "--ep-size: ep_size=4 does not match the 2 devices of this deployment"),
    (["plan", "--max-batch-size", "0"], "--max-batch-size: max_batch_size=0 must be a positive integer"),
])
def test_generate_and_plan_refuse_bad_engine_values_with_their_usage(argv, message, capsys, monkeypatch):
    # the same check for generate (before the model loads) and plan (before it plans), each with its own
    # subcommand's usage
    from m2serve.serve.cli import main

    for var in [k for k in os.environ if k.startswith("M2SERVE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr("m2serve.serve.cli._make_llm", lambda opts: pytest.fail("model loaded first"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: m2serve {argv[0]}"), err
    assert f"m2serve {argv[0]}: error: {message}" in err, err


def test_bad_engine_value_leaves_the_port_free(tmp_path):
    # the real process: `m2serve serve --max-batch-size 0` on a free port exits 2 with the usage error
    # and never listens (no uvicorn line, no loading line); the port can be bound right after
    from serve_helpers import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("M2SERVE_")}
    r = subprocess.run([sys.executable, "-m", "m2serve.serve.cli", "serve", "--host", "127.0.0.1", "--port",
                        str(port), "--max-batch-size", "0", "--log-level", "info"],
                       capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "usage: m2serve serve" in out and "m2serve serve: error: --max-batch-size:" in out, out
    assert "Uvicorn running" not in out and "loading model" not in out and "Started server" not in out, out
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
