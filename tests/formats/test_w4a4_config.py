"""W4A4 declarations and the ``activation_quant`` switch (issue 33; docs/checkpoints.md §9).

The shipped release configs declare FP4 inputs (Quark ``input_tensors``, ModelOpt
``input_activations``); ``auto`` follows them, ``none`` keeps W4A16; an input scheme m2serve cannot
reproduce is refused under ``auto`` with the reason. The flag exists on the CLI, in recipes, on
EngineArgs / LLM, and the plan prints the numerics.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import m2serve
from m2serve.config.engine_args import ACTIVATION_QUANT_MODES, EngineArgs
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine.planner import format_plan, plan_memory
from m2serve.formats.act_quant import ActivationScheme
from m2serve.formats.detect import checkpoint_quant_config, detect_quant
from m2serve.model.load import numerics_banner, resolve_activation_quant
from m2serve.serve.cli import build_parser, resolve_options
from m2serve.serve.recipe import load_recipe, recipe_overrides

HUB = Path(m2serve.__file__).parent / "checkpoints" / "hub_configs"
NV, MX = HUB / "lukealonso" / "MiniMax-M2.7-NVFP4", HUB / "amd" / "MiniMax-M2.7-MXFP4"


def _quant(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())["quantization_config"]


def test_release_configs_declare_fp4_inputs():
    assert detect_quant(_quant(MX)).activations is ActivationScheme.MXFP4
    assert detect_quant(_quant(NV)).activations is ActivationScheme.NVFP4
    assert detect_quant(*checkpoint_quant_config(NV, None)).activations is ActivationScheme.NVFP4  # hf_quant
    assert resolve_activation_quant("auto", detect_quant(_quant(MX))) is ActivationScheme.MXFP4
    assert resolve_activation_quant("none", detect_quant(_quant(MX))) is None
    assert detect_quant(None).activations is None  # dense: nothing to quantise


def test_weight_only_quark_config_runs_w4a16():
    q = copy.deepcopy(_quant(MX))
    q["global_quant_config"]["input_tensors"] = None
    assert resolve_activation_quant("auto", detect_quant(q)) is None


@pytest.mark.parametrize("key,value", [("is_dynamic", False), ("group_size", 16), ("dtype", "fp8_e4m3"),
                                       ("scale_calculation_mode", "floor")])
def test_unsupported_input_scheme_refused_under_auto(key, value):
    q = copy.deepcopy(_quant(MX))
    q["global_quant_config"]["input_tensors"][key] = value
    spec = detect_quant(q, "x/config.json")
    with pytest.raises(ValueError, match=rf"x/config\.json: quantization_config\.global_quant_config\."
                       rf"input_tensors\.{key}={value!r} is not supported .*activation_quant none"):
        resolve_activation_quant("auto", spec)
    assert resolve_activation_quant("none", spec) is None


def test_bad_activation_quant_value_names_field():
    with pytest.raises(ValueError, match=r"activation_quant='w4a4' is not supported; "
                       r"use one of \('auto', 'none'\)"):
        resolve_activation_quant("w4a4", detect_quant(None))


def test_flag_recipe_and_engine_args(tmp_path):
    assert EngineArgs().activation_quant == "auto" and ACTIVATION_QUANT_MODES == ("auto", "none")
    parser = build_parser()
    ns = parser.parse_args(["plan", "--activation-quant", "none"])
    assert resolve_options(ns, parser, environ={})["activation_quant"] == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--activation-quant", "int8"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("runtime:\n  activation_quant: none\n")
    assert recipe_overrides(load_recipe(recipe))["activation_quant"] == "none"


def test_plan_and_banner_say_the_numerics():
    for d, words in ((MX, "activations W4A4 MXFP4"), (NV, "activations W4A4 NVFP4")):
        cfg = MiniMaxM2Config.from_pretrained(d)
        args = EngineArgs(model=str(d), devices="gpu:0,1,2,3,4,5,6,7", ep_size=8, data_parallel_degree=8,
                          weight_dequant="runtime")
        text = format_plan(plan_memory(cfg, args, device_memory_gib=192))
        assert f"{words}" in text and "(activation_quant auto)" in text
        none = numerics_banner(EngineArgs(model=str(d), activation_quant="none"), cfg)
        assert none == "activations bfloat16 (W4A16) (activation_quant none)"
