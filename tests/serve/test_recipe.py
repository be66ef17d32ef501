"""Recipes (docs/serving.md §9); option precedence CLI > environment > recipe > defaults (issue 5 item 5)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m2serve.config.parallel import ParallelismMode, select_parallelism_mode
from m2serve.serve.cli import build_parser, main, resolve_options
from m2serve.serve.recipe import RecipeError, load_recipe, recipe_overrides

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MAX_RECIPES = {  # docs/serving.md §9 table: model_path, data_parallel_degree, ep_size, mode
    "minimax_m2_8x_b200": ("MiniMaxAI/MiniMax-M2.7", 8, 8, ParallelismMode.DP_EP),
    "minimax_m2_nvfp4_8x_b200": ("lukealonso/MiniMax-M2.7-NVFP4", 8, 8, ParallelismMode.DP_EP),
    "minimax_m2_mxfp4_8x_mi355": ("amd/MiniMax-M2.7-MXFP4", 8, 8, ParallelismMode.DP_EP),
    "minimax_m2_nvfp4_tp_ep_8x_b200": ("lukealonso/MiniMax-M2.7-NVFP4", 1, 8, ParallelismMode.TP_EP),
    "minimax_m2_nvfp4_tp_tp_8x_b200": ("lukealonso/MiniMax-M2.7-NVFP4", 1, 1, ParallelismMode.TP_TP),
}


def _opts(argv: list[str], environ: dict[str, str] | None = None) -> dict:
    parser = build_parser()
    return resolve_options(parser.parse_args(argv), parser, environ or {})


@pytest.mark.parametrize("name", sorted(MAX_RECIPES))
def test_max_recipes_match_spec_table(name):
    # docs/serving.md §9: all five share trust_remote_code, 8 devices, utilisation 0.8,
    # 1024 batch input tokens
    model_path, dp, ep, mode = MAX_RECIPES[name]
    o = recipe_overrides(load_recipe(RECIPES / f"{name}.yaml"))
    assert o["model"] == model_path and o["data_parallel_degree"] == dp and o.get("ep_size", 1) == ep
    assert o["devices"] == "gpu:0,1,2,3,4,5,6,7"
    assert o["device_memory_utilization"] == 0.8 and o["max_batch_input_tokens"] == 1024
    assert "ep_use_allreduce" not in o
    assert select_parallelism_mode(8, dp, ep) is mode  # the mode the spec's table lists


def test_every_shipped_recipe_parses():
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert set(MAX_RECIPES) < names  # the five MAX deployments + the CPU recipe
    for p in RECIPES.glob("*.yaml"):
        load_recipe(p)


@pytest.mark.parametrize("name", sorted(MAX_RECIPES) + ["minimax_m2_tiny_cpu"])
def test_plan_reports_mode_of_selection_function(name, capsys):
    # issue 5 "Must show": `m2serve plan --config-file RECIPE` (no weights; hub id -> shipped config)
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    n = len(raw["model"]["device_specs"]) if isinstance(raw["model"]["device_specs"], list) else 1
    expected = select_parallelism_mode(
        n, raw["model"].get("data_parallel_degree", 1), raw.get("runtime", {}).get("ep_size", 1)
    )
    assert main(["plan", "--config-file", str(RECIPES / f"{name}.yaml"), "--device-memory-gib", "180"]) == 0
    out = capsys.readouterr().out
    mode_line = next(line for line in out.splitlines() if line.startswith("parallel mode"))
    assert mode_line.split()[2].rstrip(":") == expected.value
    assert "KV pages" in out


def test_b200_fp8_plan_counts_weights_as_stored(capsys):
    # issue 30 "Must show": the FP8 release on 8 GPUs at 141 GiB holds its weights as stored by
    # default (33,478,216,704 B = 31.18 GiB per device, docs/serving.md §7), not as bf16 (59.87 GiB)
    assert main(["plan", "--config-file", str(RECIPES / "minimax_m2_8x_b200.yaml"),
                 "--device-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "weight_dequant runtime" in out
    line = next(line for line in out.splitlines() if line.startswith("weight bytes / device"))
    assert line.split()[4:] == ["31.18", "GiB", "(33,478,216,704", "B)"]


def test_plan_console_script_on_hub_id():
    # the installed console script, a hub id resolved offline to the shipped config
    exe = Path(sys.executable).with_name("m2serve")
    r = subprocess.run(
        [
            str(exe),
            "plan",
            "--config-file",
            str(RECIPES / "minimax_m2_nvfp4_tp_ep_8x_b200.yaml"),
            "--device-memory-gib",
            "180",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert r.returncode == 0, r.stderr
    assert "TP_EP" in r.stdout and "hub_configs/lukealonso/MiniMax-M2.7-NVFP4/config.json" in r.stdout


def test_unknown_key_is_an_error_naming_it(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  model_path: x\n  kv_cache:\n    device_memory_utilisation: 0.8\n")
    with pytest.raises(RecipeError, match=r"model\.kv_cache\.device_memory_utilisation: unknown key"):
        load_recipe(p)
    p.write_text("runtime:\n  ep_size: zero\n")
    with pytest.raises(RecipeError, match=r"runtime\.ep_size"):
        load_recipe(p)


def test_trust_remote_code_accepted_and_logged(tmp_path, caplog):
    p = tmp_path / "r.yaml"
    p.write_text("trust_remote_code: true\nmodel:\n  model_path: some/model\n")
    with caplog.at_level(logging.INFO, logger="m2serve.serve.recipe"):
        o = recipe_overrides(load_recipe(p))
    assert o == {"model": "some/model"}
    assert "trust_remote_code is accepted and ignored" in caplog.text


def test_precedence_cli_env_recipe_defaults(tmp_path):
    # issue 5 item 5: CLI > environment > recipe > defaults
    p = tmp_path / "r.yaml"
    p.write_text(
        "model:\n  data_parallel_degree: 2\n  kv_cache:\n    device_memory_utilization: 0.5\n"
        "runtime:\n  ep_size: 4\n  max_batch_input_tokens: 1024\n"
    )
    o = _opts(["serve", "--config-file", str(p)])
    assert (o["ep_size"], o["data_parallel_degree"], o["device_memory_utilization"]) == (4, 2, 0.5)
    assert o["max_batch_input_tokens"] == 1024 and o["port"] == 8000 and o["host"] == "127.0.0.1"  # defaults
    o = _opts(
        ["serve", "--config-file", str(p)],
        {"M2SERVE_EP_SIZE": "8", "M2SERVE_PORT": "9000", "M2SERVE_ENABLE_PREFIX_CACHING": "false"},
    )
    assert o["ep_size"] == 8 and o["port"] == 9000 and o["enable_prefix_caching"] is False
    assert o["data_parallel_degree"] == 2  # recipe still applies where env is silent
    o = _opts(
        ["serve", "--config-file", str(p), "--ep-size", "2", "--enable-prefix-caching"],
        {"M2SERVE_EP_SIZE": "8", "M2SERVE_ENABLE_PREFIX_CACHING": "0"},
    )
    assert o["ep_size"] == 2 and o["enable_prefix_caching"] is True
    o = _opts(["serve"], {"M2SERVE_CONFIG_FILE": str(p), "M2SERVE_API_KEY": "k"})
    assert o["ep_size"] == 4 and o["api_key"] == "k"
    with pytest.raises(ValueError, match="M2SERVE_PORT"):
        _opts(["serve"], {"M2SERVE_PORT": "eighty"})
    # a flag with choices: the environment value is checked against them, the error names the variable
    assert _opts(["serve"], {"M2SERVE_ATTENTION_BACKEND": "torch"})["attention_backend"] == "torch"
    # the log level is case-blind, as Python's logging names are upper case
    assert _opts(["serve"], {"M2SERVE_LOG_LEVEL": "INFO"})["log_level"] == "info"
    assert _opts(["serve", "--log-level", "DEBUG"], {})["log_level"] == "debug"
    for var, bad in (("M2SERVE_ATTENTION_BACKEND", "bogus"), ("M2SERVE_ACTIVATION_QUANT", "w4"),
                     ("M2SERVE_KV_CACHE_FORMAT", "int4")):
        with pytest.raises(ValueError, match=f"{var}='{bad}': invalid choice"):
            _opts(["serve"], {var: bad})


def test_thinking_temperature_flag_reaches_options():
    # docs/serving.md §10: the server-wide --thinking-temperature default
    # (effect on SamplingParams: test_api.py)
    assert _opts(["serve", "--thinking-temperature", "0.6"])["thinking_temperature"] == 0.6
    assert _opts(["serve"], {"M2SERVE_THINKING_TEMPERATURE": "0.4"})["thinking_temperature"] == 0.4
    assert _opts(["serve"])["thinking_temperature"] is None


def test_unreadable_recipe_names_the_file(tmp_path):
    # adversarial: --config-file pointing at a directory or a binary file is a RecipeError naming it,
    # not an IsADirectoryError / UnicodeDecodeError traceback
    with pytest.raises(RecipeError, match=rf"--config-file {tmp_path}: cannot read it as a YAML text file"):
        load_recipe(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RecipeError, match=rf"--config-file {p}: cannot read it as a YAML text file"):
        load_recipe(p)


def test_plan_prints_pages_per_replica_and_the_deployment_total(capsys):
    # issue 27 "must show": the DP8+EP8 recipe at 141 GiB per device; each replica (device) has its
    # own pool, the deployment holds 8 of them
    assert main(["plan", "--config-file", str(RECIPES / "minimax_m2_8x_b200.yaml"),
                 "--device-memory-gib", "141"]) == 0
    lines = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines() if "  " in line)
    per = lines["KV pages / replica"].strip()
    pages = int(per.split(" x ")[0].replace(",", ""))
    assert pages > 0
    assert lines["KV pages, deployment"].strip().startswith(f"8 replica(s) x {pages:,} = {8 * pages:,} pages")


def test_quantize_unquantized_flag_and_recipe_key(tmp_path):
    # docs/checkpoints.md §6 "Online FP8": CLI flag, recipe key model.quantize_unquantized, EngineArgs
    from m2serve.config.engine_args import EngineArgs
    from m2serve.serve.cli import engine_args_from

    p = tmp_path / "r.yaml"
    p.write_text("model:\n  quantize_unquantized: fp8\n")
    assert _opts(["serve", "--config-file", str(p)])["quantize_unquantized"] == "fp8"
    cli = _opts(["serve", "--config-file", str(p), "--quantize-unquantized", "none"])
    assert cli["quantize_unquantized"] == "none"
    args = EngineArgs(**engine_args_from(_opts(["serve", "--quantize-unquantized", "fp8"])))
    assert args.quantize_unquantized == "fp8"
    assert EngineArgs().quantize_unquantized == "none"
    with pytest.raises(SystemExit):
        _opts(["serve", "--quantize-unquantized", "int4"])


def test_enforce_eager_and_attention_backend_flags_and_recipe_keys(tmp_path):
    # docs/serving.md §6.3 / docs/kernels.md §7: CLI flags, recipe keys runtime.enforce_eager and
    # runtime.attention_backend, EngineArgs; the CLI wins over the recipe
    from m2serve.config.engine_args import EngineArgs
    from m2serve.serve.cli import engine_args_from

    p = tmp_path / "r.yaml"
    p.write_text("runtime:\n  enforce_eager: true\n  attention_backend: torch\n")
    opts = _opts(["serve", "--config-file", str(p)])
    assert opts["enforce_eager"] is True and opts["attention_backend"] == "torch"
    cli = _opts(["serve", "--config-file", str(p), "--no-enforce-eager", "--attention-backend", "triton"])
    assert cli["enforce_eager"] is False and cli["attention_backend"] == "triton"
    args = EngineArgs(**engine_args_from(_opts(["serve", "--enforce-eager"])))
    assert args.enforce_eager is True and EngineArgs().enforce_eager is False
    p.write_text("runtime:\n  attention_backend: flash\n")
    with pytest.raises(RecipeError, match=r"runtime\.attention_backend: .*'flash' is not one of "
                                          r"\['auto', 'torch', 'triton'\]"):
        load_recipe(p)
