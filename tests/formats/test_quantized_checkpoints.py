"""Real FP4 exports of tiny-random, loaded unconverted, against the fp32 oracle (issue 7).

docs/checkpoints.md §4 (detection, per-linear header check), §6 (formulas), §8 (produce / check with
the reference libraries); docs/model.md §6 (oracle: transformers in fp32 on a dense copy dequantised
by the reference library, |Δlogit| <= 1e-4 * max(1, |logit|)).

- ModelOpt NVFP4: produced by ModelOpt itself on CPU (``mtq.quantize`` W4A4 NVFP4 +
  ``export_hf_checkpoint`` on transformers' MiniMaxM2, attention / router / lm_head excluded
  like the lukealonso release). Dense copy: ``NVFP4QTensor.dequantize``.
- compressed-tensors NVFP4: the ModelOpt export converted by compressed-tensors' own
  ``convert_checkpoint`` + ``ModelOptNvfp4Converter`` (weight_packed, weight_global_scale =
  1 / weight_scale_2). Dense copy: ``unpack_fp4_from_uint8`` + its ``dequantize``.
- compressed-tensors MXFP4: written with compressed-tensors' own ``calculate_qparams`` (MX
  scales) and ``MXFP4PackedCompressor.compress``; dense copy: ``MXFP4PackedCompressor.decompress``.
- Quark MXFP4: written with Quark's own ``PerBlockMXObserver`` (OCP MXFP4, even rounding),
  ``real_quantize_fp4_fp6_per_group``, ``Pack_fp4`` and ``to_e8m0_uint8`` in Quark's export
  names and config (Quark's quantiser skips transformers' fused expert tensors, so its end-to-end
  export cannot be used). Dense copy: ``dequantize_fp4_fp6_per_group``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.formats.detect import Encoding, LinearKind, checkpoint_quant_config, detect_quant
from m2serve.formats.fp4 import PackedFP4
from m2serve.formats.fp8 import PackedFP8
from m2serve.formats.loader import open_checkpoint, read_input_scales
from m2serve.kernels.build import kernel_backend
from m2serve.model.load import load_model
from m2serve.model.simple_cache import SimpleKVCache

pytestmark = pytest.mark.slow  # transformers oracle runs over every format and step

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import (
        dequantize_fp4_fp6_per_group,
        real_quantize_fp4_fp6_per_group,
    )
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.observer.observer import PerBlockMXObserver
    from quark.torch.utils.numerics import to_e8m0_uint8
    from quark.torch.utils.pack import Pack_fp4

PROMPT_LENS = (5, 9)
DECODE_STEPS = 3



# ---- producing the checkpoints with the reference libraries --------------------------------------

def _weights(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(d / f))
    return out


def _write(d: Path, tensors: dict[str, torch.Tensor], config: dict, src: Path,
           extra_files: tuple[str, ...] = ("generation_config.json",)) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(config, indent=1))
    for f in extra_files:
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    return d


def modelopt_export(src: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """ModelOpt's own NVFP4 quantisation + HF export of the dense checkpoint ``src`` into ``out``."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = transformers.MiniMaxM2ForCausalLM.from_pretrained(src, dtype=dtype)
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)  # W4A4 NVFP4, as the release recipe
    cfg["quant_cfg"] += [{"quantizer_name": pat, "enable": False}
                         for pat in ("*self_attn*", "*lm_head*", "*mlp.gate.*")]
    g = torch.Generator().manual_seed(0)

    def calibrate(m):
        for _ in range(4):
            m(torch.randint(0, model.config.vocab_size, (2, 16), generator=g))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, calibrate)
        export_hf_checkpoint(model, export_dir=out)
    return out


@pytest.fixture(scope="module")
def modelopt_dir(tiny_random_dir, tmp_path_factory) -> Path:
    return modelopt_export(tiny_random_dir, tmp_path_factory.mktemp("nvfp4") / "modelopt")


@pytest.fixture(scope="module")
def ct_dir(modelopt_dir, tmp_path_factory) -> Path:
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    out = tmp_path_factory.mktemp("nvfp4") / "compressed-tensors"
    ignore = ["lm_head", "model.embed_tokens", r"re:.*self_attn.*", r"re:.*block_sparse_moe\.gate$"]
    convert_checkpoint(modelopt_dir, out, ModelOptNvfp4Converter(ignore=ignore, targets=["Linear"]),
                       max_workers=1, device="cpu")
    return out


@pytest.fixture(scope="module")
def ct_mxfp4_dir(tiny_random_dir, tmp_path_factory) -> Path:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    fmt = CompressionFormat.mxfp4_pack_quantized.value
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4, format=fmt)
    tensors = {}
    for name, t in _weights(tiny_random_dir).items():
        if ".experts." in name:
            w = t.float()
            groups = w.view(w.shape[0], -1, 32)
            scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
            sd = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                scheme)
            tensors.update({name + "_packed": sd["weight_packed"], name + "_scale": sd["weight_scale"]})
        else:
            tensors[name] = t
    config = json.loads((tiny_random_dir / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
        ignore=["lm_head", r"re:.*self_attn.*", r"re:.*block_sparse_moe\.gate$"]).model_dump(mode="json")
    return _write(tmp_path_factory.mktemp("mxfp4") / "compressed-tensors", tensors, config, tiny_random_dir)


QUARK_CONFIG = {  # the amd/MiniMax-M2.7-MXFP4 quantization_config (docs/checkpoints.md §4), trimmed
    "quant_method": "quark", "quant_mode": "eager_mode",
    "global_quant_config": {
        "weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
                   "scale_format": "e8m0", "scale_calculation_mode": "even", "round_method": "half_even",
                   "observer_cls": "PerBlockMXObserver", "is_dynamic": False},
        "input_tensors": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
                          "scale_format": "e8m0", "scale_calculation_mode": "even",
                          "round_method": "half_even", "observer_cls": "PerBlockMXObserver",
                          "is_dynamic": True},
        "output_tensors": None, "bias": None},
    "exclude": ["lm_head", "*block_sparse_moe.gate*", "*self_attn*"],
    "export": {"weight_format": "real_quantized", "pack_method": "reorder"},
}


def _quark_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark's own MXFP4 weight path: observer scale, real quantise, pack, E8M0 encode."""
    obs = PerBlockMXObserver(OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec())
    obs(w)
    scale, _ = obs.calculate_qparams()  # [N, K/32] f32 powers of two
    q = real_quantize_fp4_fp6_per_group(w, scale, axis=-1, group_size=32, quant_dtype="fp4")
    return Pack_fp4("per_group", "fp4").pack(q, reorder=False), to_e8m0_uint8(scale)


def quark_export(src: Path, out: Path) -> Path:
    """The dense checkpoint ``src`` with every expert weight in Quark's MXFP4 export layout."""
    tensors = {}
    for name, t in _weights(src).items():
        if ".experts." in name:
            packed, scale = _quark_mxfp4(t.float())
            tensors[name], tensors[name[: -len("weight")] + "weight_scale"] = packed, scale
        else:
            tensors[name] = t
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUARK_CONFIG
    return _write(out, tensors, config, src)


@pytest.fixture(scope="module")
def quark_dir(tiny_random_dir, tmp_path_factory) -> Path:
    return quark_export(tiny_random_dir, tmp_path_factory.mktemp("mxfp4") / "quark")


# ---- the oracle: a dense copy dequantised by the reference library -------------------------------

def _ref_modelopt(t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    packed = t[p + "weight"]
    shape = torch.Size([packed.shape[0], 2 * packed.shape[1]])
    return NVFP4QTensor(shape, torch.float32, packed).dequantize(
        dtype=torch.float32, scale=t[p + "weight_scale"], double_scale=t[p + "weight_scale_2"],
        block_sizes={-1: 16})


def _ref_ct(t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    packed = t[p + "weight_packed"]
    n, k = packed.shape[0], 2 * packed.shape[1]
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    return ct_dequantize(unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32),
                         scale=t[p + "weight_scale"].float(), args=args,
                         global_scale=t[p + "weight_global_scale"], dtype=torch.float32)


def _ref_ct_mxfp4(t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4)
    sd = {"weight_packed": t[p + "weight_packed"], "weight_scale": t[p + "weight_scale"]}
    return MXFP4PackedCompressor.decompress(sd, scheme)["weight"].float()  # exact: 2-bit codes x 2^e


def _ref_quark(t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    values = Pack_fp4("per_group", "fp4").unpack(t[p + "weight"], reorder=False)
    scale = 2 ** (t[p + "weight_scale"].to(torch.int16) - 127).to(torch.float32)  # Quark unpack_params (e8m0)
    return dequantize_fp4_fp6_per_group(values, scale, axis=-1, group_size=32)


_FP4_PARTS = ("weight", "weight_packed", "weight_scale", "weight_scale_2", "weight_global_scale",
              "input_scale", "input_global_scale")


def dense_copy(src: Path, out: Path, ref: Callable[[dict[str, torch.Tensor], str], torch.Tensor]) -> Path:
    """``src`` with every packed FP4 set replaced by ``ref``'s fp32 dequantisation, no quant config."""
    t = _weights(src)
    dense: dict[str, torch.Tensor] = {}
    for name, v in t.items():
        prefix, _, part = name.rpartition(".")
        packed = t.get(prefix + ".weight", t.get(prefix + ".weight_packed"))
        if part in _FP4_PARTS and packed is not None and packed.dtype == torch.uint8:
            if part in ("weight", "weight_packed"):
                dense[prefix + ".weight"] = ref(t, prefix + ".")
        else:
            dense[name] = v
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    return _write(out, dense, config, src)


def assert_logits_match_oracle(path: Path, oracle_dir: Path, oracle_mode: Callable = contextlib.nullcontext,
                               **load_kw) -> torch.Tensor:
    """Ragged prefill (all positions) + teacher-forced decode steps vs transformers fp32 (docs/model.md §6).
    W4A16 (activation_quant none) unless ``load_kw`` says otherwise: the oracle's inputs are unquantised,
    unless ``oracle_mode(ref)`` (a context manager around every oracle forward) quantises them."""
    ours = load_model(path, dtype=torch.float32, **{"activation_quant": "none", **load_kw})
    ref = transformers.MiniMaxM2ForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).float().eval()
    with oracle_mode(ref):
        return _compare_logits(ours, ref)


def _compare_logits(ours, ref) -> torch.Tensor:
    rng = random.Random(0)
    prompts = [[rng.randrange(ours.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    cache = SimpleKVCache.create(ours.config, num_pages=16, page_size=4)
    got = [ours(cache.batch(list(enumerate(prompts)), return_n_logits=10**6), cache.storage)]
    with torch.no_grad():
        want = [torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])]
        seqs = [list(p) for p in prompts]
        last = want[0][torch.tensor(PROMPT_LENS).cumsum(0) - 1]  # [B, V] each prompt's last position
        for _ in range(DECODE_STEPS):  # teacher-forced with the oracle's greedy tokens
            nxt = last.argmax(-1).tolist()
            for seq, tok in zip(seqs, nxt):
                seq.append(tok)
            got.append(ours(cache.batch([(i, [tok]) for i, tok in enumerate(nxt)]), cache.storage))
            last = torch.stack([ref(torch.tensor([seq])).logits[0, -1] for seq in seqs])
            want.append(last)
    got_t, want_t = torch.cat(got), torch.cat(want).float()
    err = (got_t - want_t).abs()
    tol = 1e-4 * want_t.abs().clamp(min=1.0)
    assert bool((err <= tol).all()), f"max |Δlogit| {err.max():.3g} (max |logit| {want_t.abs().max():.3g})"
    return got_t


# ---- must show: each real export loads and matches the oracle -----------------------------------

def test_modelopt_export_layout(modelopt_dir):  # docs/checkpoints.md §2, §4, §7 (lukealonso release layout)
    cfg = MiniMaxM2Config.from_pretrained(modelopt_dir)
    assert cfg.quantization_config["quant_method"] == "modelopt"
    plan = open_checkpoint(modelopt_dir, cfg)
    assert plan.quant.encoding is Encoding.NVFP4
    kinds = {k: v for k, v in plan.kinds.items()}
    assert all(v is LinearKind.NVFP4 for k, v in kinds.items() if ".experts." in k)
    assert all(v is LinearKind.DENSE for k, v in kinds.items() if ".self_attn." in k)
    assert plan.reader.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "BF16"
    plan.reader.close()


def test_modelopt_nvfp4_matches_oracle(modelopt_dir, tmp_path):  # docs/checkpoints.md §6 NVFP4 (ModelOpt)
    assert_logits_match_oracle(modelopt_dir, dense_copy(modelopt_dir, tmp_path / "dense", _ref_modelopt))


def test_compressed_tensors_nvfp4_matches_oracle(ct_dir, tmp_path):  # docs/checkpoints.md §4 c-t
    cfg = MiniMaxM2Config.from_pretrained(ct_dir)
    assert cfg.quantization_config["quant_method"] == "compressed-tensors"
    assert (ct_dir / "hf_quant_config.json").exists()  # stale ModelOpt file: config.json decides
    plan = open_checkpoint(ct_dir, cfg)
    assert {v for k, v in plan.kinds.items() if ".experts." in k} == {LinearKind.NVFP4_CT}
    plan.reader.close()
    assert_logits_match_oracle(ct_dir, dense_copy(ct_dir, tmp_path / "dense", _ref_ct))


def test_compressed_tensors_mxfp4_matches_oracle(ct_mxfp4_dir, tmp_path):  # docs/checkpoints.md §4, §6 MXFP4
    plan = open_checkpoint(ct_mxfp4_dir, MiniMaxM2Config.from_pretrained(ct_mxfp4_dir))
    assert plan.quant.encoding is Encoding.MXFP4 and plan.quant.ct_patterns
    assert {v for k, v in plan.kinds.items() if ".experts." in k} == {LinearKind.MXFP4}
    plan.reader.close()
    assert_logits_match_oracle(ct_mxfp4_dir, dense_copy(ct_mxfp4_dir, tmp_path / "dense", _ref_ct_mxfp4))


def test_quark_mxfp4_matches_oracle(quark_dir, tmp_path):  # docs/checkpoints.md §6 MXFP4 (Quark)
    plan = open_checkpoint(quark_dir, MiniMaxM2Config.from_pretrained(quark_dir))
    assert plan.quant.encoding is Encoding.MXFP4
    assert {v for k, v in plan.kinds.items() if ".experts." in k} == {LinearKind.MXFP4}
    plan.reader.close()
    assert_logits_match_oracle(quark_dir, dense_copy(quark_dir, tmp_path / "dense", _ref_quark))


def test_hf_quant_config_alone_is_detected(modelopt_dir, tmp_path):  # docs/checkpoints.md §1, §4
    t = _weights(modelopt_dir)
    config = json.loads((modelopt_dir / "config.json").read_text())
    config.pop("quantization_config")
    d = _write(tmp_path / "ckpt", t, config, modelopt_dir, ("generation_config.json", "hf_quant_config.json"))
    plan = open_checkpoint(d, MiniMaxM2Config.from_pretrained(d))
    assert plan.quant.encoding is Encoding.NVFP4 and plan.quant.source.endswith("hf_quant_config.json")
    assert plan.quant.excluded_by("model.layers.1.self_attn.o_proj") == "model.layers.1.self_attn*"
    plan.reader.close()


HUB_CONFIGS = Path(__file__).resolve().parents[2] / "src/m2serve/checkpoints/hub_configs"


@pytest.mark.parametrize("repo,encoding,source", [
    ("lukealonso/MiniMax-M2.7-NVFP4", Encoding.NVFP4, "config.json"),
    ("lukealonso/MiniMax-M2.7-NVFP4", Encoding.NVFP4, "hf_quant_config.json"),
    ("amd/MiniMax-M2.7-MXFP4", Encoding.MXFP4, "config.json"),
])
def test_release_configs_detected(repo, encoding, source):  # docs/checkpoints.md §4, §7 (the shipped configs)
    d = HUB_CONFIGS / repo
    config = json.loads((d / "config.json").read_text())
    quant = config["quantization_config"] if source == "config.json" else None
    spec = detect_quant(*checkpoint_quant_config(d, quant))
    assert spec.encoding is encoding and spec.source.endswith(source)
    assert spec.excluded_by("lm_head") == "lm_head"
    assert spec.excluded_by("model.layers.61.self_attn.o_proj") is not None
    assert spec.excluded_by("model.layers.61.block_sparse_moe.gate") is not None
    assert spec.excluded_by("model.layers.61.block_sparse_moe.experts.255.w2") is None


def test_bad_hf_quant_config_names_file(tmp_path):  # docs/checkpoints.md §1
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "hf_quant_config.json").write_text('{"producer": {"name": "modelopt"}}')
    with pytest.raises(ValueError, match=r"ckpt/hf_quant_config\.json: not a ModelOpt hf_quant_config\.json "
                       r"\(needs a 'quantization' object"):
        checkpoint_quant_config(d, None)


def test_missing_input_scale_recorded_as_one(modelopt_dir, tmp_path):  # docs/checkpoints.md §3.3
    t = _weights(modelopt_dir)
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.input_scale"
    kept = "model.layers.0.block_sparse_moe.experts.0.w1.input_scale"
    d = _write(tmp_path / "ckpt", {k: v for k, v in t.items() if k != gone},
               json.loads((modelopt_dir / "config.json").read_text()), modelopt_dir)
    plan = open_checkpoint(d, MiniMaxM2Config.from_pretrained(d))
    scales = read_input_scales(plan)
    plan.reader.close()
    assert scales[gone.replace("input_scale", "weight")] == 1.0
    assert scales[kept.replace("input_scale", "weight")] == t[kept].item() != 1.0
    assert len(scales) == 2 * 8 * 3  # every expert linear has one
    # none in the file at all -> nothing recorded (the 1.0 rule only fills gaps)
    d2 = _write(tmp_path / "none", {k: v for k, v in t.items() if not k.endswith("input_scale")},
                json.loads((modelopt_dir / "config.json").read_text()), modelopt_dir)
    plan = open_checkpoint(d2, MiniMaxM2Config.from_pretrained(d2))
    assert read_input_scales(plan) == {}
    plan.reader.close()


# ---- --weight-dequant runtime: same logits, less resident memory (issue 7 must show) ----------

def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct torch storages behind the model's parameters and buffers."""
    storages = {}
    for t in (*model.parameters(), *model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("fixture", ["modelopt_dir", "ct_dir", "quark_dir", "ct_mxfp4_dir"])
def test_runtime_dequant_same_logits_less_memory(fixture, request, monkeypatch):  # docs/checkpoints.md §6
    d = request.getfixturevalue(fixture)
    models = {mode: load_model(d, dtype=torch.float32, weight_dequant=mode, activation_quant="none")
              for mode in ("load", "runtime")}
    cfg = models["load"].config
    L, E, H, I = cfg.num_hidden_layers, cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    group, scale_bytes, scalar_bytes = (16, 1, 4) if "mxfp4" not in fixture and fixture != "quark_dir" \
        else (32, 1, 0)
    packed = L * E * 3 * (I * H // 2 + I * H // group * scale_bytes + scalar_bytes)
    dense = L * E * 3 * I * H * 4  # fp32 w13 + w2
    assert resident_bytes(models["runtime"]) == resident_bytes(models["load"]) - dense + packed
    assert resident_bytes(models["runtime"]) < 0.75 * resident_bytes(models["load"])

    out, calls = logits_and_decode_dequants(models, PackedFP4, monkeypatch)
    # one token dequantises top-k experts x 3 matrices per layer, unless the CPU kernels compute the
    # experts from the codes (issue 18: then nothing is dequantised, same weight values, another fp32
    # summation order)
    if kernel_backend().available:
        assert calls["runtime"] == []
        torch.testing.assert_close(out["runtime"], out["load"], rtol=1e-5, atol=1e-5)
    else:
        assert len(calls["runtime"]) == L * cfg.num_experts_per_tok * 3
        assert torch.equal(out["runtime"], out["load"])


def logits_and_decode_dequants(models: dict, packed_cls: type, monkeypatch) -> tuple[dict, dict]:
    """Prefill 8 tokens, then decode one, with each model: (logits per mode, the dtypes of the
    ``packed_cls.dequantize`` calls made during that model's decode step)."""
    calls: list = []
    real = packed_cls.dequantize
    monkeypatch.setattr(packed_cls, "dequantize",
                        lambda self, dtype: calls.append(dtype) or real(self, dtype))
    out, decode_calls = {}, {}
    for mode, model in models.items():
        cache = SimpleKVCache.create(model.config, num_pages=8, page_size=4)
        prefill = model(cache.batch([(0, [3, 1, 4, 1, 5, 9, 2, 6])], return_n_logits=10**6), cache.storage)
        calls.clear()
        decode = model(cache.batch([(0, [7])]), cache.storage)
        decode_calls[mode] = list(calls)
        out[mode] = torch.cat([prefill, decode])
    return out, decode_calls


def test_fp8_runtime_dequant_same_logits_less_memory(tiny_random_fp8_dir, monkeypatch):
    # docs/checkpoints.md §6 execution choices, docs/serving.md §7 (the planner's runtime weights =
    # as stored):
    # every FP8 block linear stays e4m3 + fp32 block scales; attention linears dequantise per forward,
    # experts only when activated; logits identical to dequantising at load
    d = tiny_random_fp8_dir
    plan = open_checkpoint(d, MiniMaxM2Config.from_pretrained(d))
    shapes = [plan.reader.tensors[plan.files[c]].shape
              for c, k in plan.kinds.items() if k is LinearKind.FP8_BLOCK]
    plan.reader.close()
    models = {mode: load_model(d, dtype=torch.float32, weight_dequant=mode) for mode in ("load", "runtime")}
    cfg = models["load"].config
    dense = sum(n * k * 4 for n, k in shapes)
    stored = sum(n * k + -(-n // 128) * -(-k // 128) * 4 for n, k in shapes)
    assert len(shapes) == cfg.num_hidden_layers * (4 + 3 * cfg.num_local_experts)
    assert resident_bytes(models["runtime"]) == resident_bytes(models["load"]) - dense + stored
    held = [b for b in models["runtime"].buffers() if b.dtype == torch.float8_e4m3fn]
    assert sum(b.numel() for b in held) == sum(n * k for n, k in shapes)

    out, calls = logits_and_decode_dequants(models, PackedFP8, monkeypatch)
    # one decode token: top-k experts x 3 matrices per layer, in fp32, plus q/k/v/o, unless the CPU
    # kernels compute all of them from the codes (issue 18: then none); none when loaded dense
    kernels = kernel_backend().available
    per_layer = 0 if kernels else 4 + cfg.num_experts_per_tok * 3
    assert calls["runtime"] == [torch.float32] * cfg.num_hidden_layers * per_layer
    assert calls["load"] == []
    if kernels:  # same weight values, another fp32 summation order
        torch.testing.assert_close(out["runtime"], out["load"], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out["runtime"], out["load"])


def test_engine_args_weight_dequant_runtime(quark_dir):  # EngineArgs.weight_dequant -> load_model
    from m2serve.config.engine_args import EngineArgs
    from m2serve.engine.core import LLMEngine
    from m2serve.engine.sampling import SamplingParams

    tokens = {}
    for mode in ("load", "runtime"):
        engine = LLMEngine.from_args(EngineArgs(model=str(quark_dir), dtype="float32", weight_dequant=mode,
                                                num_kv_pages=16, kv_cache_page_size=16))
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("r", [5, 7, 11, 13], params)
        out = []
        while engine.has_unfinished_requests():
            out += [t for o in engine.step() for t in o.new_token_ids]
        tokens[mode] = out
    assert len(tokens["load"]) == 6 and tokens["runtime"] == tokens["load"]


def test_weight_dequant_value_checked(modelopt_dir):  # EngineArgs.weight_dequant
    with pytest.raises(ValueError, match=r"weight_dequant='lazy' is not supported; use one of"):
        load_model(modelopt_dir, weight_dequant="lazy")


# ---- errors: each raised with its message asserted (issue 7 "Errors") ---------------------------

def _mutated(src: Path, out: Path, drop: tuple[str, ...] = (), put: dict | None = None,
             quant: Callable[[dict], None] | None = None) -> Path:
    t = {k: v for k, v in _weights(src).items() if k not in drop}
    t.update(put or {})
    config = json.loads((src / "config.json").read_text())
    if quant:
        quant(config["quantization_config"])
    return _write(out, t, config, src)


def _plan_error(d: Path) -> None:
    open_checkpoint(d, MiniMaxM2Config.from_pretrained(d))


W1 = "model.layers.0.block_sparse_moe.experts.2.w1."


def test_missing_scale_names_tensor(modelopt_dir, quark_dir, tmp_path):  # docs/checkpoints.md §4
    d = _mutated(modelopt_dir, tmp_path / "a", drop=(W1 + "weight_scale",))
    with pytest.raises(ValueError, match=rf"{W1}weight: U8 weight without a recognised scale set: no "
                       r"weight_scale \(packed FP4 needs F8_E4M3 weight_scale \+ weight_scale_2"):
        _plan_error(d)
    d = _mutated(modelopt_dir, tmp_path / "b", drop=(W1 + "weight_scale_2",))
    with pytest.raises(ValueError, match=rf"{W1}weight: NVFP4 weight is missing its weight_scale_2 tensor "
                       rf"\({W1}weight_scale_2\)"):
        _plan_error(d)
    d = _mutated(quark_dir, tmp_path / "c", drop=(W1 + "weight_scale",))
    with pytest.raises(ValueError, match=rf"{W1}weight: U8 weight without a recognised scale set"):
        _plan_error(d)


def test_wrong_scale_shape_names_tensor(modelopt_dir, quark_dir, tmp_path):  # docs/checkpoints.md §4
    t = _weights(modelopt_dir)
    d = _mutated(modelopt_dir, tmp_path / "a", put={W1 + "weight_scale": t[W1 + "weight_scale"][:, :8]})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale: scale shape \[512, 8\] does not match weight "
                       rf"{W1}weight \[512, 256\] in groups of 16 along K \(expected \[512, 16\]\)"):
        _plan_error(d)
    bad = torch.full((512, 16), 127, dtype=torch.uint8)
    d = _mutated(quark_dir, tmp_path / "b", put={W1 + "weight_scale": bad})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale: scale shape \[512, 16\] does not match weight "
                       rf"{W1}weight \[512, 256\] in groups of 32 along K \(expected \[512, 8\]\)"):
        _plan_error(d)


def test_unknown_quant_algo(modelopt_dir, tmp_path):  # docs/checkpoints.md §4
    d = _mutated(modelopt_dir, tmp_path / "a", quant=lambda q: q.update(quant_algo="W4A8_AWQ"))
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\.quant_algo='W4A8_AWQ' is not "
                       r"supported \(ModelOpt checkpoints: NVFP4\)"):
        _plan_error(d)


def test_group_size_other_than_16_or_32(modelopt_dir, quark_dir, ct_dir, tmp_path):  # docs/checkpoints.md §4
    d = _mutated(modelopt_dir, tmp_path / "a",
                 quant=lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32))
    with pytest.raises(ValueError, match=r"quantization_config\.config_groups\.group_0\.weights\."
                       r"group_size=32 is not supported \(NVFP4 uses group size 16; supported FP4 group "
                       r"sizes: NVFP4 16, MXFP4 32\)"):
        _plan_error(d)
    d = _mutated(quark_dir, tmp_path / "b",
                 quant=lambda q: q["global_quant_config"]["weight"].update(group_size=64))
    with pytest.raises(ValueError, match=r"quantization_config\.global_quant_config\.weight\.group_size=64 "
                       r"is not supported \(MXFP4 uses group size 32"):
        _plan_error(d)
    d = _mutated(ct_dir, tmp_path / "c",
                 quant=lambda q: q["config_groups"]["config_group_0"]["weights"].update(group_size=64))
    with pytest.raises(ValueError, match=r"config_groups\.config_group_0\.weights\.group_size=64 is not "
                       r"supported \(supported FP4 group sizes: NVFP4 16, MXFP4 32\)"):
        _plan_error(d)


def test_e8m0_nan_scale_names_tensor(quark_dir, tmp_path):  # docs/checkpoints.md §5 (255 = NaN)
    s = _weights(quark_dir)[W1 + "weight_scale"].clone()
    s[7, 3] = 255
    d = _mutated(quark_dir, tmp_path / "a", put={W1 + "weight_scale": s})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale: 1 E8M0 scale\(s\) hold the NaN code 255 "
                       r"\(first at index \[7, 3\]\); the checkpoint is corrupt"):
        load_model(d, dtype=torch.float32)


def test_exclude_list_is_checked_against_headers(modelopt_dir, quark_dir, tmp_path):  # docs/checkpoints.md §4
    d = _mutated(modelopt_dir, tmp_path / "a", quant=lambda q: q["ignore"].append("*experts.2*"))
    with pytest.raises(ValueError, match=rf"{W1[:-1]}: nvfp4 weight, but \S*config\.json excludes it "
                       r"from quantisation \(pattern '\*experts\.2\*'\)"):
        _plan_error(d)
    d = _mutated(quark_dir, tmp_path / "b", quant=lambda q: q.update(exclude=["lm_head"]))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.\w_proj: dense weight, but "
                       r"\S*config\.json quantises it \(it matches no ignore/exclude pattern\)"):
        _plan_error(d)


def test_conventions_are_never_mixed(ct_dir, modelopt_dir, tmp_path):  # docs/checkpoints.md §4
    t = _weights(ct_dir)
    gs = t[W1 + "weight_global_scale"]
    d = _mutated(ct_dir, tmp_path / "a", drop=(W1 + "weight_global_scale",),
                 put={W1 + "weight_scale_2": 1 / gs})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale_2: weight_scale_2 belongs to the ModelOpt "
                       rf"convention but {W1}weight_packed uses compressed-tensors names"):
        _plan_error(d)
    d = _mutated(modelopt_dir, tmp_path / "b", quant=lambda q: q.update(quant_algo="FP8"))
    with pytest.raises(ValueError, match=r"quant_algo='FP8' is not supported"):
        _plan_error(d)


# ---- the trained tiny-chat re-quantised: same greedy tokens (issue 7) ----------------------------

TINY_CHAT = Path(__file__).resolve().parents[2] / "src/m2serve/checkpoints/tiny-chat"
TEXT_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
sys.path.insert(0, str(TINY_CHAT.parents[3]))  # the repository root: tools.tiny_chat (held-out prompts)


@pytest.fixture(scope="module")
def tiny_chat_dense(tmp_path_factory) -> Path:
    """tiny-chat with its FP8 block weights dequantised to fp32 (docs/checkpoints.md §6 FP8), no quant
    config."""
    from m2serve.formats.fp8 import dequantize_fp8_block

    t = _weights(TINY_CHAT)
    dense = {}
    for name, v in t.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = t.get(name + "_scale_inv")
        dense[name] = dequantize_fp8_block(v, scale, torch.float32) if scale is not None else v.float()
    config = json.loads((TINY_CHAT / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    return _write(tmp_path_factory.mktemp("tiny-chat") / "dense", dense, config, TINY_CHAT, TEXT_FILES)


def _greedy(path: Path, examples, dtype: str = "float32", **engine_args) -> list[list[int]]:
    """Greedy token ids (eos removed) of each example's prompt through m2serve's LLM (fp32 default;
    W4A16, activation_quant none, unless ``engine_args`` says otherwise)."""
    from tools.tiny_chat import evaluate as ev

    engine_args.setdefault("activation_quant", "none")
    gens = ev.generate_m2serve(path, examples, max_tokens=32, dtype=dtype, kv_cache_format=dtype,
                               **engine_args)
    return [g.token_ids for g in gens]


def _held_out_examples() -> list:
    from tools.tiny_chat import data

    return [ex for kind in ("tool_call", "tool_result", "no_tool", "plain")
            for ex in data.eval_subset(kind, 5, seed=7)]


@pytest.fixture(scope="module")
def tiny_chat_requantised(tiny_chat_dense, tmp_path_factory):
    """fmt ("nvfp4-modelopt" | "mxfp4-quark") -> tiny-chat's experts re-quantised by the reference
    library (attention, router and lm_head excluded like the releases), built once per module."""
    built: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in built:
            out = tmp_path_factory.mktemp(fmt)
            if fmt == "nvfp4-modelopt":
                q = modelopt_export(tiny_chat_dense, out / "nvfp4", dtype=torch.float32)
            else:
                q = quark_export(tiny_chat_dense, out / "mxfp4")
            for f in TEXT_FILES:  # tokenizer, template and generation config for the engine
                shutil.copy(tiny_chat_dense / f, q / f)
            built[fmt] = q
        return built[fmt]

    return get


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "mxfp4-quark"])
def test_tiny_chat_requantised_keeps_greedy_tokens(fmt, tiny_chat_dense, tiny_chat_requantised):
    # issue 7 "must show": tiny-chat's NVFP4 and MXFP4 re-quantisations (experts; attention, router
    # and lm_head excluded like the releases) give the same greedy tokens as its dequantised weights on
    # at least 19 of 20 held-out prompts over 32 steps
    q = tiny_chat_requantised(fmt)
    want_kind = LinearKind.NVFP4 if fmt == "nvfp4-modelopt" else LinearKind.MXFP4
    plan = open_checkpoint(q, MiniMaxM2Config.from_pretrained(q))
    assert {v for k, v in plan.kinds.items() if ".experts." in k} == {want_kind}
    plan.reader.close()
    examples = _held_out_examples()
    base, got = _greedy(tiny_chat_dense, examples), _greedy(q, examples)
    assert min(map(len, base)) >= 8  # real continuations, not an immediate stop
    same = sum(a == b for a, b in zip(base, got))
    assert same >= 19, f"{fmt}: greedy tokens equal on {same}/20 prompts"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4-modelopt", "mxfp4-quark"])
def test_tiny_chat_packed_kernels_keep_greedy_tokens(fmt, dtype, tiny_chat_requantised):
    # issue 18 "must show": the engine's greedy tokens on tiny-chat (FP8 as shipped) and on its NVFP4 /
    # MXFP4 re-quantisations are identical with the weights kept packed (the CPU kernels compute from
    # the codes: weight_dequant runtime, and auto, the default) and dequantised at load (aten GEMMs),
    # on 20 held-out prompts x 32 steps, in the serving default bf16 and in fp32
    assert kernel_backend().available, kernel_backend().banner()
    q = TINY_CHAT if fmt == "fp8" else tiny_chat_requantised(fmt)
    examples = _held_out_examples()
    got = {wd: _greedy(q, examples, dtype, weight_dequant=wd) for wd in ("load", "runtime", "auto")}
    assert min(map(len, got["load"])) >= 8  # real continuations, not an immediate stop
    assert got["runtime"] == got["load"]
    assert got["auto"] == got["load"]


@pytest.mark.parametrize("weight_dequant", ["load", "runtime"])  # issue 16 item 7: packed weights too
def test_fp4_nan_scales_refused_in_both_modes(modelopt_dir, quark_dir, tmp_path, weight_dequant):
    s = _weights(quark_dir)[W1 + "weight_scale"].clone()
    s[7, 3] = 255  # E8M0 NaN
    d = _mutated(quark_dir, tmp_path / "mx", put={W1 + "weight_scale": s})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale: 1 E8M0 scale\(s\) hold the NaN code 255 "
                       r"\(first at index \[7, 3\]\); the checkpoint is corrupt"):
        load_model(d, dtype=torch.float32, weight_dequant=weight_dequant)
    s = _weights(modelopt_dir)[W1 + "weight_scale"].clone()
    s.view(torch.uint8)[2, 5] = 0x7F  # e4m3 NaN code in an NVFP4 block scale
    d = _mutated(modelopt_dir, tmp_path / "nv", put={W1 + "weight_scale": s})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale: 1 FP8 e4m3 value\(s\) hold a NaN code "
                       r"\(0x7F/0xFF\) \(first at index \[2, 5\]\)"):
        load_model(d, dtype=torch.float32, weight_dequant=weight_dequant)
    s2 = _weights(modelopt_dir)[W1 + "weight_scale_2"].clone().fill_(float("inf"))
    d = _mutated(modelopt_dir, tmp_path / "nv2", put={W1 + "weight_scale_2": s2})
    with pytest.raises(ValueError, match=rf"{W1}weight_scale_2: 1 value\(s\) are NaN or inf"):
        load_model(d, dtype=torch.float32, weight_dequant=weight_dequant)


# ---- W4A4: MXFP4 activations as Quark's input_tensors declare them (issue 33) ---------------------

def _quark_input_quantizer():
    from quark.torch.quantization.tensor_quantize import DynamicScaledFakeQuantize

    return DynamicScaledFakeQuantize(OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec())


class QuarkExpertInputs(torch.overrides.TorchFunctionMode):
    """transformers' MiniMaxM2 with amd-quark's dynamic MXFP4 fake quantiser on the input of every
    expert product: each ``F.linear`` whose weight is a view of an experts module's ``gate_up_proj``
    or ``down_proj`` (transformers keeps the experts fused, so there is no per-expert module to hook)
    gets ``fq(input)``; the experts run transformers' eager loop (``_experts_implementation``), whose
    products are those ``F.linear`` calls. Also records the MoE blocks' inputs (``moe_inputs``) and, per
    expert product pair, ``pairs``: (MoE block call, expert, w13 input rows, w2 input rows), unquantised."""

    def __init__(self, model):
        super().__init__()
        self.fq = _quark_input_quantizer()
        experts = [m for m in model.modules() if type(m).__name__ == "MiniMaxM2Experts"]
        for m in experts:
            m.config._experts_implementation = "eager"
        self.bases = {id(p) for m in experts for p in (m.gate_up_proj, m.down_proj)}
        self.calls = 0
        self.moe_inputs: list[torch.Tensor] = []
        self.pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._w13: tuple[int, int, torch.Tensor] | None = None
        self.hooks = [m.register_forward_pre_hook(lambda _m, a: self.moe_inputs.append(a[0].detach().clone()))
                      for m in model.modules() if type(m).__name__ == "MiniMaxM2SparseMoeBlock"]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and id(getattr(args[1], "_base", None)) in self.bases:
            self.calls += 1
            w = args[1]
            expert = w.storage_offset() // w.numel()
            if w.shape[0] > w.shape[1]:  # gate_up_proj [2I, H] (I < H in tiny-chat) then down_proj [H, I]
                self._w13 = (len(self.moe_inputs) - 1, expert, args[0].detach().clone())
            elif w.shape[0] < w.shape[1] and self._w13 is not None:
                self.pairs.append((*self._w13, args[0].detach().clone()))
            args = (self.fq(args[0]), *args[1:])
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


def test_tiny_chat_mxfp4_w4a4_matches_quark_oracle(tiny_chat_requantised, tmp_path):
    # issue 33 "must show": tiny-chat re-quantised to Quark MXFP4 with input_tensors declared, loaded
    # with activation_quant auto (W4A4, docs/checkpoints.md §9), against transformers' MiniMaxM2 on the
    # Quark-dequantised weights with Quark's fake quantiser on the same linears' inputs: logits within
    # 1e-4 (fp32). Reports the rounding-boundary flips at the MoE inputs (elements whose quantised
    # value differs because m2serve's and transformers' inputs differ in their last bits).
    from m2serve.model.decoder import MiniMaxM2ForCausalLM

    q = tiny_chat_requantised("mxfp4-quark")
    plan = open_checkpoint(q, MiniMaxM2Config.from_pretrained(q))
    assert plan.quant.activations is not None and plan.quant.activations.value == "mxfp4"
    plan.reader.close()
    oracle = dense_copy(q, tmp_path / "dense", _ref_quark)
    modes: list[QuarkExpertInputs] = []

    def quark_inputs(ref):
        modes.append(QuarkExpertInputs(ref))
        return modes[-1]

    ours_inputs: list[torch.Tensor] = []
    ours_calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # the FP4 x FP4 kernel's (input, offsets)
    from m2serve.kernels import ops

    real = ops.cpu_w4a4_grouped_linear

    def recording(x, offsets, *rest):
        ours_calls.append((x.detach().clone(), offsets.clone()))
        return real(x, offsets, *rest)

    ops.cpu_w4a4_grouped_linear = recording
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: ours_inputs.append(a[0].detach().clone())
        if type(m).__name__ == "MiniMaxM2SparseMoeBlock" and m.__module__.startswith("m2serve") else None)
    try:
        assert_logits_match_oracle(q, oracle, quark_inputs, activation_quant="auto")
    finally:
        hook.remove()
        ops.cpu_w4a4_grouped_linear = real
    assert modes[0].calls > 0 and MiniMaxM2ForCausalLM  # the oracle's expert inputs were quantised
    # ... and on CPU the experts ran the FP4 x FP4 kernels (docs/checkpoints.md §9.1), not qdq + W4A16
    summary = load_model(q, dtype=torch.float32, activation_quant="auto").kernel_summary.banner()
    assert ("cpu-w4a4" in summary) == kernel_backend().available, summary
    # the prefill: ours is one ragged batch, the oracle one forward per prompt -> compare per token
    L = len(ours_inputs) // (1 + DECODE_STEPS)
    ours_prefill = ours_inputs[:L]
    ref_prefill = [torch.cat([modes[0].moe_inputs[p * L + layer][0] for p in range(len(PROMPT_LENS))])
                   for layer in range(L)]
    fq = _quark_input_quantizer()
    flips = sum(int((fq(a.float()) != fq(b.float())).sum()) for a, b in zip(ours_prefill, ref_prefill))
    total = sum(a.numel() for a in ours_prefill)
    print(f"W4A4 MXFP4 tiny-chat: {flips} rounding-boundary flips in {total} MoE-input (w13 input) elements "
          "(prefill)")
    # the w2 inputs (silu(gate) * up per token and expert), every expert product of the prefill: ours
    # from the kernel's calls (w13's then w2's per layer, rows sorted by expert), the oracle's from its
    # down_proj calls; rows matched by (layer, expert, token), tokens found by their MoE-input row
    assert len(ours_calls) >= 2 * L  # the experts ran the FP4 x FP4 kernel

    def token_of(rows: torch.Tensor, moe_in: torch.Tensor) -> list[int]:
        return [int((moe_in == r).all(-1).nonzero()[0, 0]) for r in rows]

    ours_w2: dict[tuple[int, int, int], torch.Tensor] = {}
    for layer in range(L):
        (x13, offs), (x2, _) = ours_calls[2 * layer], ours_calls[2 * layer + 1]
        experts = torch.searchsorted(offs, torch.arange(x13.shape[0], dtype=offs.dtype), right=True)
        for r, tok in enumerate(token_of(x13[:int(offs[-1])], ours_prefill[layer])):
            ours_w2[layer, int(experts[r]), tok] = x2[r]
    starts = [sum(PROMPT_LENS[:p]) for p in range(len(PROMPT_LENS))]
    ref_w2: dict[tuple[int, int, int], torch.Tensor] = {}
    for call, expert, x13, x2 in modes[0].pairs:
        p, layer = divmod(call, L)
        if p >= len(PROMPT_LENS):
            break  # the teacher-forced decode steps
        for r, tok in enumerate(token_of(x13, modes[0].moe_inputs[call][0])):
            ref_w2[layer, expert, starts[p] + tok] = x2[r]
    common = sorted(ours_w2.keys() & ref_w2.keys())
    assert len(common) >= 0.9 * len(ref_w2)  # the same routing, but for near-tied router scores
    a = torch.stack([ours_w2[k] for k in common]).float()
    b = torch.stack([ref_w2[k] for k in common]).float()
    flips2 = int((fq(a) != fq(b)).sum())
    print(f"W4A4 MXFP4 tiny-chat: {flips2} rounding-boundary flips in {a.numel()} w2-input elements "
          f"(prefill, {len(common)} of {len(ref_w2)} (token, expert) pairs routed alike)")


def test_tiny_chat_mxfp4_w4a4_greedy_tokens(tiny_chat_dense, tiny_chat_requantised):
    # issue 33 "must show": held-out greedy tokens of the W4A4 MXFP4 tiny-chat (activation_quant auto)
    # vs the dense checkpoint on 20 prompts x 32 steps (W4A16 keeps >= 19/20, issue 7's test above)
    q = tiny_chat_requantised("mxfp4-quark")
    examples = _held_out_examples()
    base, got = _greedy(tiny_chat_dense, examples), _greedy(q, examples, activation_quant="auto")
    same = sum(a == b for a, b in zip(base, got))
    print(f"W4A4 MXFP4 tiny-chat: greedy tokens equal to the dense checkpoint on {same}/20 prompts")
    assert same >= 19, f"W4A4 greedy tokens equal on {same}/20 prompts"


def test_modelopt_nvfp4_w4a4_takes_each_experts_input_scale(modelopt_dir, tmp_path):
    # issue 33 item 1 (docs/checkpoints.md §9): with activation_quant auto a ModelOpt NVFP4 export quantises
    # each expert's inputs under that expert's own input_scale (w1 = w3, they share the input); a
    # checkpoint declaring NVFP4 inputs but holding no input scale is refused under auto, runs under none
    plan = open_checkpoint(modelopt_dir, MiniMaxM2Config.from_pretrained(modelopt_dir))
    scales = read_input_scales(plan)
    plan.reader.close()
    models = {aq: load_model(modelopt_dir, dtype=torch.float32, activation_quant=aq)
              for aq in ("auto", "none")}
    for i, layer in enumerate(models["auto"].model.layers):
        experts = layer.block_sparse_moe.experts
        assert experts.act_scheme.value == "nvfp4"
        for e in range(experts.num_local):
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            assert experts.input_scale[e].tolist() == [scales[p + "w1.weight"], scales[p + "w2.weight"]]
    assert models["none"].model.layers[0].block_sparse_moe.experts.act_scheme is None
    cache = SimpleKVCache.create(models["auto"].config, num_pages=8, page_size=4)
    out = {aq: m(cache.batch([(0, [3, 1, 4, 1, 5])]), cache.storage) for aq, m in models.items()}
    assert not torch.allclose(out["auto"], out["none"])  # the inputs really are quantised
    t = _weights(modelopt_dir)
    d = _write(tmp_path / "no-input-scale", {k: v for k, v in t.items() if not k.endswith("input_scale")},
               json.loads((modelopt_dir / "config.json").read_text()), modelopt_dir)
    with pytest.raises(ValueError, match=r"declares NVFP4 input activations but the checkpoint holds no "
                       r"input_scale / input_global_scale tensor; pass activation_quant none"):
        load_model(d, dtype=torch.float32)
    load_model(d, dtype=torch.float32, activation_quant="none")


def test_compressed_tensors_nvfp4_w4a4_takes_its_own_rules(ct_dir):
    # issue 33 item 3 (docs/checkpoints.md §9): a compressed-tensors NVFP4 export (here: compressed-tensors'
    # own converter of the ModelOpt one) declaring its inputs quantises each expert's inputs with
    # compressed-tensors' rules (qdq_nvfp4_ct, bit-equal to its forward_quantize in
    # tests/formats/test_act_quant.py) under that expert's input_global_scale, held exactly as stored
    from m2serve.formats.act_quant import ActivationScheme, qdq_nvfp4_ct
    from m2serve.kernels.choice import LinearImpl

    plan = open_checkpoint(ct_dir, MiniMaxM2Config.from_pretrained(ct_dir))
    assert plan.quant.activations is ActivationScheme.NVFP4_CT
    plan.reader.close()
    t = _weights(ct_dir)
    model = load_model(ct_dir, dtype=torch.float32, activation_quant="auto")
    ex = model.model.layers[0].block_sparse_moe.experts
    assert ex.act_scheme is ActivationScheme.NVFP4_CT
    for e in range(ex.num_local):
        p = f"model.layers.0.block_sparse_moe.experts.{e}."
        want = [float(t[p + w + ".input_global_scale"].float().reshape(-1)[0]) for w in ("w1", "w2")]
        assert ex.input_scale[e].tolist() == want  # bit-exact: not the reciprocal of a reciprocal
    # on CPU with the kernels: the FP4 x FP4 kernel, with compressed-tensors' rule (docs/checkpoints.md §9.1)
    assert (ex.choice.impl is LinearImpl.CPU_W4A4) == kernel_backend().available
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, ex.hidden_size, generator=g)
    got = ex.grouped_rows(x, torch.tensor([5] + [5] * (ex.num_local - 1), dtype=torch.int32))
    w13, w2 = ex.expert_weights(0, torch.float32)
    F = torch.nn.functional
    gate, up = F.linear(qdq_nvfp4_ct(x, ex.input_scale[0, 0]), w13).chunk(2, dim=-1)
    ref = F.linear(qdq_nvfp4_ct(F.silu(gate) * up, ex.input_scale[0, 1]), w2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ---- --quantize-unquantized fp8: the bf16 attention / lm_head of an MXFP4 release in FP8 blocks --

def test_quantize_unquantized_fp8_runs_mxfp4_attention_through_fp8(quark_dir, monkeypatch):
    # docs/checkpoints.md §6 "Online FP8": attention q/k/v/o and lm_head are held as e4m3 codes +
    # amax/448 block scales; the experts stay MXFP4; the forward equals a dense model holding the
    # bit-exact dequantisation (formats/fp8.py, transformers-checked in test_fp8.py) of those codes
    from m2serve.formats.fp8 import dequantize_fp8_block
    from m2serve.kernels.ops import WeightFormat
    from m2serve.model import linear as linear_mod
    from m2serve.model.linear import Linear

    # W4A16 experts (activation_quant none): this test is about the attention; the checkpoint's
    # declared FP4 inputs and their kernels (cpu-w4a4) are tested in test_w4a4_kernel.py
    base = load_model(quark_dir, dtype=torch.float32, weight_dequant="runtime", activation_quant="none")
    quant = load_model(quark_dir, dtype=torch.float32, weight_dequant="runtime", activation_quant="none",
                       quantize_unquantized="fp8")
    cfg = quant.config
    lins = {n: m for n, m in quant.named_modules() if isinstance(m, Linear)}
    assert len(lins) == 4 * cfg.num_hidden_layers + 1 and all(m.packed for m in lins.values())
    for name, m in lins.items():
        w = base.get_submodule(name).weight
        # per-element bound of a round-to-nearest e4m3 code: half an ulp (2^-4 relative), or half
        # the smallest subnormal step (2^-10 x s) near zero
        s_el = m.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        s_el = s_el[:w.shape[0], :w.shape[1]]
        back = dequantize_fp8_block(m.weight_q, m.weight_scale_inv, torch.float32)
        assert (back - w).abs().le(w.abs() * 2**-4 + s_el * 2**-10).all(), name
        blk = torch.nn.functional.pad(w.abs(), (0, -w.shape[1] % 128, 0, -w.shape[0] % 128))
        amax = blk.reshape(blk.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3))
        assert torch.equal(m.weight_scale_inv, torch.where(amax > 0, amax / 448, 1.0)), name
        base.get_submodule(name).weight.data.copy_(back)  # the dense reference holds the same values
    kernels = kernel_backend().available
    label = kernel_backend().name if kernels else "torch"
    assert quant.kernel_summary.counts[("linear", "FP8_BLOCK", label)] == len(lins)
    assert quant.kernel_summary.counts[("experts", "MXFP4", label)] == cfg.num_hidden_layers

    seen = []
    real = linear_mod.cpu_linear
    monkeypatch.setattr(linear_mod, "cpu_linear",
                        lambda x, w, isa, *a: seen.append(w.fmt) or real(x, w, isa, *a))
    cache = {k: SimpleKVCache.create(cfg, num_pages=8, page_size=4) for k in ("base", "quant")}
    out = {}
    for key, model in (("base", base), ("quant", quant)):
        seen.clear()
        c = cache[key]
        prefill = model(c.batch([(0, [3, 1, 4, 1, 5, 9, 2, 6])], return_n_logits=10**6), c.storage)
        out[key] = torch.cat([prefill, model(c.batch([(0, [7])]), c.storage)])
        fmts = list(seen)
    if kernels:  # the quantised model's prefill and decode ran every linear on FP8 codes
        assert fmts == [WeightFormat.FP8_BLOCK] * 2 * len(lins)
    torch.testing.assert_close(out["quant"], out["base"], rtol=1e-5, atol=1e-5)


def test_quantize_unquantized_value_checked(quark_dir):  # EngineArgs.quantize_unquantized
    with pytest.raises(ValueError, match=r"quantize_unquantized='int4' is not supported; use one of"):
        load_model(quark_dir, quantize_unquantized="int4")
