"""Deployment recipes: YAML files with MAX's recipe keys (docs/serving.md §9).

Schema (every key optional; unknown keys are an error naming the key and its path)::

    trust_remote_code: true          # accepted and ignored (m2serve never runs checkpoint code)
    model:
      model_path: MiniMaxAI/MiniMax-M2.7
      served_model_name: ...
      trust_remote_code: true
      device_specs: [0, 1, 2, 3]     # GPU ids, or strings "gpu:0" / "cpu" / "cpu:2"
      data_parallel_degree: 8
      max_length: 32768
      quantize_unquantized: fp8      # none | fp8 (docs/checkpoints.md §6 "Online FP8")
      kv_cache:
        device_memory_utilization: 0.8
        kv_cache_page_size: 128
        kv_cache_format: bfloat16
        enable_prefix_caching: true
    runtime:
      ep_size: 8
      ep_use_allreduce: false
      max_batch_input_tokens: 1024
      max_batch_size: 256
      max_queue_size: 1024
      thinking_temperature: 1.0
      activation_quant: auto         # auto (W4A4 as the checkpoint declares) | none (W4A16)
      attention_backend: auto        # auto | torch | triton (docs/kernels.md §7)
      enforce_eager: false           # true: no CUDA graphs (docs/serving.md §6.3)
      speculative_config:            # off when absent (docs/serving.md §13)
        method: ngram
        num_speculative_tokens: 4

:func:`recipe_overrides` flattens a recipe into the CLI's flag names (``--ep-size`` ->
``ep_size``); the CLI applies CLI > environment > recipe > defaults.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from m2serve.config.engine_args import ATTENTION_BACKENDS, parse_speculative_config

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class KVCacheSection(_Strict):
    device_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    kv_cache_page_size: int | None = Field(default=None, ge=1)
    kv_cache_format: str | None = None
    enable_prefix_caching: bool | None = None


class ModelSection(_Strict):
    model_path: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool | None = None
    device_specs: list[int | str] | str | None = None
    data_parallel_degree: int | None = Field(default=None, ge=1)
    max_length: int | None = Field(default=None, ge=1)
    quantize_unquantized: str | None = None
    kv_cache: KVCacheSection | None = None


class RuntimeSection(_Strict):
    ep_size: int | None = Field(default=None, ge=1)
    ep_use_allreduce: bool | None = None
    max_batch_input_tokens: int | None = Field(default=None, ge=1)
    max_batch_size: int | None = Field(default=None, ge=1)
    max_queue_size: int | None = Field(default=None, ge=0)
    thinking_temperature: float | None = Field(default=None, ge=0.0)
    activation_quant: Literal["auto", "none"] | None = None
    speculative_config: dict[str, Any] | str | None = None
    attention_backend: str | None = None
    enforce_eager: bool | None = None

    @field_validator("attention_backend")
    @classmethod
    def _backend(cls, v: str | None) -> str | None:
        if v is not None and v not in ATTENTION_BACKENDS:
            raise ValueError(f"{v!r} is not one of {list(ATTENTION_BACKENDS)}")
        return v


class Recipe(_Strict):
    """A validated recipe (docs/serving.md §9)."""

    trust_remote_code: bool | None = None
    model: ModelSection = Field(default_factory=ModelSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)


class RecipeError(ValueError):
    """A recipe file that cannot be read or does not match the schema."""


def devices_from_specs(specs: list[int | str] | str) -> str:
    """MAX ``device_specs`` -> the ``--devices`` string: [0, 1] -> ``gpu:0,1``; ["cpu"] -> ``cpu``."""
    if isinstance(specs, str):
        return specs
    if not specs:
        raise RecipeError("model.device_specs is empty (give GPU ids such as [0, 1] or 'cpu')")
    if all(isinstance(s, int) for s in specs):
        return "gpu:" + ",".join(str(s) for s in specs)
    if len(specs) == 1:
        return str(specs[0])
    ids = []
    for s in specs:
        kind, _, idx = str(s).partition(":")
        if kind != "gpu" or not idx.isdigit():
            raise RecipeError(
                f"model.device_specs entry {s!r}: mix GPU ids only (e.g. [0, 1] or ['gpu:0', 'gpu:1'])"
            )
        ids.append(idx)
    return "gpu:" + ",".join(ids)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file.

    Raises RecipeError naming the file and, for schema errors, each offending key path
    (e.g. ``model.kv_cache.foo: unknown key``).
    """
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError as e:
        raise RecipeError(f"--config-file {p}: no such file") from e
    except yaml.YAMLError as e:
        raise RecipeError(f"--config-file {p}: invalid YAML ({e})") from e
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8 text
        raise RecipeError(f"--config-file {p}: cannot read it as a YAML text file ({e})") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"--config-file {p}: top level must be a mapping, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"--config-file {p}: " + "; ".join(_describe(err) for err in e.errors())) from e
    try:
        parse_speculative_config(recipe.runtime.speculative_config)
    except ValueError as e:
        raise RecipeError(f"--config-file {p}: runtime.{e}") from e
    if recipe.trust_remote_code is not None or recipe.model.trust_remote_code is not None:
        log.info("%s: trust_remote_code is accepted and ignored (m2serve never executes checkpoint code)", p)
    return recipe


def _describe(err: dict[str, Any]) -> str:
    where = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    return f"{where}: {err['msg']}"


def recipe_overrides(recipe: Recipe) -> dict[str, Any]:
    """Flatten a recipe into ``{cli_dest: value}`` for the keys it sets."""
    m, r = recipe.model, recipe.runtime
    kv = m.kv_cache or KVCacheSection()
    out: dict[str, Any] = {
        "model": m.model_path,
        "served_model_name": m.served_model_name,
        "devices": devices_from_specs(m.device_specs) if m.device_specs is not None else None,
        "data_parallel_degree": m.data_parallel_degree,
        "max_length": m.max_length,
        "quantize_unquantized": m.quantize_unquantized,
        "device_memory_utilization": kv.device_memory_utilization,
        "kv_cache_page_size": kv.kv_cache_page_size,
        "kv_cache_format": kv.kv_cache_format,
        "enable_prefix_caching": kv.enable_prefix_caching,
        "ep_size": r.ep_size,
        "ep_use_allreduce": r.ep_use_allreduce,
        "max_batch_input_tokens": r.max_batch_input_tokens,
        "max_batch_size": r.max_batch_size,
        "max_queue_size": r.max_queue_size,
        "thinking_temperature": r.thinking_temperature,
        "activation_quant": r.activation_quant,
        "attention_backend": r.attention_backend,
        "enforce_eager": r.enforce_eager,
        "speculative_config": r.speculative_config,
    }
    return {k: v for k, v in out.items() if v is not None}
