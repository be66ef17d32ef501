"""Model resolution: ``--model`` (local directory, hub id or nothing) -> a local path.

- None -> the embedded default checkpoint, ``tiny-chat`` (``m2serve.checkpoints.default_model_path``),
  shipped in the package; no download.
- An existing local directory -> itself.
- A shipped checkpoint's name (``tiny-chat``, ``tiny-chat-eagle3``: ``m2serve.checkpoints.EMBEDDED_MODELS``)
  with no local directory of that name -> the shipped directory.
- A hub id ``org/name`` -> a snapshot in the huggingface_hub cache (its layout, ``HF_HOME`` /
  ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``): no network when the snapshot is cached; downloaded
  when online and missing.

For planning without weights (:func:`resolve_config`), a hub id also resolves to the public
config shipped in ``m2serve/checkpoints/hub_configs/<org>/<name>/config.json``.

An EAGLE-3 draft named by hub id in ``speculative_config.model`` resolves the same way
(:func:`resolve_engine_args`, called by ``LLM``, torchrun's rank setup, and the CLI's option check
and ``plan`` before ``EngineArgs``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from m2serve.checkpoints import EMBEDDED_MODELS, default_model_path
from m2serve.config.engine_args import looks_like_hub_id, parse_speculative_config

__all__ = ["HUB_CONFIGS", "ModelNotFoundError", "looks_like_hub_id", "resolve_config", "resolve_engine_args",
           "resolve_model"]

log = logging.getLogger(__name__)

HUB_CONFIGS = Path(__file__).resolve().parent.parent / "checkpoints" / "hub_configs"


class ModelNotFoundError(FileNotFoundError):
    """``--model`` names neither a local directory nor a resolvable hub id."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(model: str | None, what: str = "--model", config_only: bool = False) -> Path:
    """Resolve ``--model`` to a local checkpoint directory holding config.json and the weights
    (``config_only``: a hub id's snapshot need only hold config.json; a download fetches nothing
    else — for planning).

    Raises ModelNotFoundError naming ``what`` (the option: ``--model`` or
    ``speculative_config.model``), the value and what was tried (local path, hub cache, and whether
    HF_HUB_OFFLINE prevented a download).
    """
    if model is None or model == "":
        return default_model_path()
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model]
    if not looks_like_hub_id(model):
        raise ModelNotFoundError(
            f"{what} {model!r}: no such directory (and not a hub id of the form org/name, nor a shipped "
            f"checkpoint: {', '.join(EMBEDDED_MODELS)})"
        )
    from huggingface_hub import snapshot_download

    only = {"allow_patterns": ["config.json"]} if config_only else {}
    try:
        return Path(snapshot_download(model, local_files_only=True, **only))
    except Exception as cached_err:  # noqa: BLE001 - huggingface_hub raises several types here
        if hub_offline():
            raise ModelNotFoundError(
                f"{what} {model!r}: not in the Hugging Face cache and HF_HUB_OFFLINE is set "
                f"(download it first with `hf download {model}` or unset HF_HUB_OFFLINE)"
            ) from cached_err
    try:
        log.info("downloading %s from the Hugging Face hub", model)
        return Path(snapshot_download(model, **only))
    except Exception as e:  # noqa: BLE001
        raise ModelNotFoundError(
            f"{what} {model!r}: could not download from the hub ({type(e).__name__}: "
            f"{' '.join(str(e).split())})"
        ) from e


def resolve_engine_args(engine_args: dict[str, Any], config_only: bool = False) -> dict[str, Any]:
    """``engine_args`` with an EAGLE-3 draft's ``speculative_config.model`` (docs/serving.md §14)
    resolved as :func:`resolve_model` resolves ``--model``: a local directory (``~`` expanded) or a
    hub id ``org/name`` -> its snapshot in the hub cache (downloaded when online and missing).
    Anything else comes back unchanged: a bad ``speculative_config`` is left to whoever parses it
    next (the CLI's option check, the planner, the engine: ``parse_speculative_config``, whose error
    names the field). ``config_only``: the draft's config.json is all that is fetched (``plan``).
    Raises ModelNotFoundError naming ``speculative_config.model``."""
    try:
        spec = parse_speculative_config(engine_args.get("speculative_config"))
    except ValueError:
        return engine_args
    if spec is None or spec.model is None:
        return engine_args
    local = resolve_model(spec.model, "speculative_config.model", config_only)
    if str(local) != spec.model:
        log.info("speculative_config.model %s: %s", spec.model, local)
    fields = {f: getattr(spec, f) for f in spec.__slots__ if getattr(spec, f) is not None}
    return {**engine_args, "speculative_config": {**fields, "model": str(local)}}


def resolve_config(model: str | None) -> Path:
    """Resolve ``--model`` to a config.json for planning (no weights needed).

    Order: a config.json file itself; a local directory; the hub cache (config.json only);
    the shipped hub config. Raises ModelNotFoundError naming the shipped ids otherwise.
    """
    if model is None or model == "":
        return default_model_path() / "config.json"
    p = Path(model).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        return p / "config.json"
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model] / "config.json"
    if not looks_like_hub_id(model):
        raise ModelNotFoundError(f"--model {model!r}: no such file or directory (and not a hub id org/name, "
                                 f"nor a shipped checkpoint: {', '.join(EMBEDDED_MODELS)})")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")
    if isinstance(cached, str) and Path(cached).is_file():
        return Path(cached)
    shipped = HUB_CONFIGS / model / "config.json"
    if shipped.is_file():
        return shipped
    known = sorted(str(c.parent.relative_to(HUB_CONFIGS)) for c in HUB_CONFIGS.glob("*/*/config.json"))
    raise ModelNotFoundError(
        f"--model {model!r}: config.json is not in the Hugging Face cache and m2serve "
        f"ships no config for it (shipped: {', '.join(known) or 'none'})"
    )
