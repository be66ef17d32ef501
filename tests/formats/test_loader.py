"""Strict checkpoint loading and the bad-checkpoint cases (docs/checkpoints.md §1, §3, §4; issue 2)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2serve.config.model_config import MiniMaxM2Config
from m2serve.formats.fp8 import PackedFP8, dequantize_fp8_block
from m2serve.formats.loader import CheckpointMismatchError, iter_weights, open_checkpoint, packed_fp8
from m2serve.formats.safetensors_io import INDEX_FILE, CheckpointFormatError
from m2serve.model.load import load_model

SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def ckpt(tiny_random_dir, tmp_path):
    """A private copy of tiny-random (bf16) to damage."""
    return shutil.copytree(tiny_random_dir, tmp_path / "ckpt")


def _index(d):
    return json.loads((d / INDEX_FILE).read_text())


def _edit_shard(d, shard, fn):
    """Rewrite ``shard`` with fn(tensors) and keep the index in step."""
    tensors = fn(load_file(str(d / shard)))
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    idx = _index(d)
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != shard}
    idx["weight_map"].update({n: shard for n in tensors})
    (d / INDEX_FILE).write_text(json.dumps(idx))


def _shard_of(d, name):
    return _index(d)["weight_map"][name]


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_config_missing_hidden_size(ckpt):
    # docs/model.md §1: required field, error names the field and the file
    _edit_config(ckpt, hidden_size=None)
    with pytest.raises(ValueError, match=r"config\.json.*'hidden_size' is missing"):
        load_model(ckpt)


def test_missing_expert_tensor(ckpt):
    # docs/checkpoints.md §3.7: missing required tensors are listed
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    _edit_shard(ckpt, _shard_of(ckpt, name), lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointMismatchError, match=r"1 required tensor\(s\) missing: " + re.escape(name)):
        load_model(ckpt)


def test_extra_unknown_tensor(ckpt):
    # docs/checkpoints.md §3.7: leftovers are an error listing their names
    name = "model.layers.0.self_attn.extra_proj.bias"
    _edit_shard(ckpt, SHARD2, lambda t: {**t, name: torch.zeros(4)})
    with pytest.raises(CheckpointMismatchError, match=r"unknown tensor.*" + re.escape(name)):
        load_model(ckpt)


def test_decoy_shard_not_in_index_is_ignored(ckpt):
    # docs/checkpoints.md §1: only the files named by the index are read; a stray file repeating
    # tensor names (with other values) must not be loaded
    name = "model.layers.0.self_attn.q_proj.weight"
    real = load_file(str(ckpt / _shard_of(ckpt, name)))[name]
    decoy = {name: torch.zeros_like(real), "junk.weight": torch.ones(3)}
    save_file(decoy, str(ckpt / "model-decoy.safetensors"))
    model = load_model(ckpt)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, real.float())


def test_truncated_safetensors(ckpt):
    # docs/checkpoints.md §1: a truncated file names the file, the tensor and the byte counts
    f = ckpt / SHARD2
    data = f.read_bytes()
    f.write_bytes(data[:-1000])
    with pytest.raises(CheckpointFormatError,
                       match=rf"{SHARD2}: truncated: tensor '.*' ends at data byte \d+ but the file"):
        load_model(ckpt)


def test_corrupt_header(ckpt):
    f = ckpt / SHARD2
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff" * 8
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=rf"{SHARD2}: corrupt safetensors header"):
        load_model(ckpt)


def test_gptq_quantization_config(ckpt):
    # docs/checkpoints.md §4: GPTQ refused as MAX does
    _edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(NotImplementedError, match="GPTQ MiniMax-M2 checkpoints are not supported"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    # docs/checkpoints.md §3.7: shape mismatch names the tensor, found and expected shapes
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = torch.zeros(256, 512, dtype=torch.bfloat16)
    _edit_shard(ckpt, _shard_of(ckpt, name), lambda t: {**t, name: bad})
    with pytest.raises(CheckpointMismatchError,
                       match=re.escape(name) + r" has shape \[256, 512\], expected \[256, 1024\]"):
        load_model(ckpt)


def test_index_names_missing_shard(ckpt):
    (ckpt / SHARD2).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard {SHARD2}"):
        load_model(ckpt)


def test_dropped_and_optional_tensors_are_accepted(ckpt):
    # docs/checkpoints.md §3.1, 3.2, 3.6: MTP layers, *_quantizer*, rotary inv_freq dropped;
    # k_scale / v_scale consumed by the fp8 KV cache
    extra = {"model.layers.2.self_attn.q_proj.weight": torch.ones(4, 4),  # MTP (L = 2)
             "model.layers.0.self_attn.q_proj.input_quantizer._amax": torch.ones(1),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32),
             "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.25),
             "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(0.5)}
    _edit_shard(ckpt, SHARD2, lambda t: {**t, **extra})
    model = load_model(ckpt)
    assert model.kv_scales == ([1.0, 0.25], [1.0, 0.5])


def test_mlp_spelling_accepted(ckpt, tiny_random_dir):
    # docs/checkpoints.md §3: gate, bias and experts may be spelled mlp.
    for shard in sorted({*_index(ckpt)["weight_map"].values()}):
        _edit_shard(ckpt, shard, lambda t: {k.replace("block_sparse_moe.", "mlp."): v for k, v in t.items()})
    a, b = load_model(ckpt), load_model(tiny_random_dir)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_single_file_without_index(ckpt, tiny_random_dir):
    tensors = {}
    for shard in sorted({*_index(ckpt)["weight_map"].values()}):
        tensors.update(load_file(str(ckpt / shard)))
        (ckpt / shard).unlink()
    (ckpt / INDEX_FILE).unlink()
    save_file(tensors, str(ckpt / "model.safetensors"))
    a, b = load_model(ckpt), load_model(tiny_random_dir)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_router_held_in_fp32(tiny_random_dir):
    # docs/model.md §5.1: gate and bias fp32 whatever the compute dtype
    model = load_model(tiny_random_dir, dtype=torch.bfloat16)
    moe = model.model.layers[0].block_sparse_moe
    assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_shard_plan_reads_slices(tiny_random_fp8_dir):
    # loader hook for TP/EP: rows of an FP8 weight on 128-block boundaries, experts skipped
    cfg = MiniMaxM2Config.from_pretrained(tiny_random_fp8_dir)
    full = dict(iter_weights(open_checkpoint(tiny_random_fp8_dir, cfg), torch.float32))

    def plan(name, shape):
        if ".experts." in name:
            return "skip"
        if name.endswith("q_proj.weight"):
            return (0, 512, 1024)
        if name.endswith("o_proj.weight"):
            return (1, 128, 384)
        return None

    part = dict(iter_weights(open_checkpoint(tiny_random_fp8_dir, cfg), torch.float32, plan))
    assert not any(".experts." in n for n in part)
    q = "model.layers.1.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(part[q], full[q][512:1024])
    assert torch.equal(part[o], full[o][:, 128:384])


def test_fp8_slices_that_split_a_scale_band(tiny_random_fp8_dir):
    # issue 30: a TP slice may start (and end) inside a 128-wide band, rows (column-parallel q/k/v,
    # w1/w3) and columns (row-parallel o_proj, w2): the rank keeps the bands it touches and the
    # offset; its weight equals the same rows / columns of formats/fp8.py's dequantisation of the
    # whole stored tensor, bit for bit, dequantised at load and held packed
    cfg = MiniMaxM2Config.from_pretrained(tiny_random_fp8_dir)
    cuts = {"q_proj": (0, 64, 640), "k_proj": (0, 192, 384), "o_proj": (1, 320, 832), "w1": (0, 192, 384),
            "w2": (1, 64, 256)}

    def plan(name, shape):
        return cuts.get(name.rsplit(".", 2)[-2])

    whole = open_checkpoint(tiny_random_fp8_dir, cfg)
    for packed in (False, True):
        for name, t in iter_weights(open_checkpoint(tiny_random_fp8_dir, cfg), torch.bfloat16, plan,
                                    packed=packed):
            cut = plan(name, None)
            if cut is None or name not in whole.kinds:
                continue
            dim, a, b = cut
            full = packed_fp8(whole, name)
            ref = dequantize_fp8_block(full.q, full.scale, torch.bfloat16)
            ref = ref[a:b] if dim == 0 else ref[:, a:b]
            if packed:
                offsets = (a % 128, 0) if dim == 0 else (0, a % 128)
                assert isinstance(t, PackedFP8) and (t.row0, t.col0) == offsets
                assert t.scale.shape[dim] == -(-b // 128) - a // 128, name
                t = t.dequantize(torch.bfloat16)
            assert torch.equal(t, ref), (name, packed)


def test_fp8_scale_wrong_shape(tiny_random_fp8_dir, tmp_path):
    # docs/checkpoints.md §4: a scale of the wrong shape is an error naming the tensor
    d = shutil.copytree(tiny_random_fp8_dir, tmp_path / "fp8")
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    _edit_shard(d, _shard_of(d, name), lambda t: {**t, name: torch.ones(2, 1)})
    with pytest.raises(ValueError, match=re.escape(name) + r": FP8 block scale must be float \[4, 2\]"):
        load_model(d)


def test_use_routing_bias_false_without_bias_tensor(ckpt):
    # docs/model.md §1: use_routing_bias false and no bias tensor -> bias = 0 (not a missing tensor)
    for shard in sorted({*_index(ckpt)["weight_map"].values()}):
        _edit_shard(ckpt, shard, lambda t: {k: v for k, v in t.items() if "e_score_correction_bias" not in k})
    with pytest.raises(CheckpointMismatchError, match="missing: .*e_score_correction_bias"):
        load_model(ckpt)
    _edit_config(ckpt, use_routing_bias=False)
    model = load_model(ckpt)
    for layer in model.model.layers:
        assert torch.equal(layer.block_sparse_moe.e_score_correction_bias, torch.zeros(8))


def _edit_header(d, shard, fn):
    """Rewrite the JSON header of ``shard`` with fn(header) (data section untouched)."""
    import struct
    raw = (d / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.dumps(fn(json.loads(raw[8:8 + n]))).encode()
    head += b" " * (-len(head) % 8)
    (d / shard).write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("edit", [
    lambda h: [1, 2],  # header a JSON list
    lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": ["0", "8"]}},
    lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": [-1, -8]}},
    lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": ["a"]}},
])
def test_lying_header_is_a_format_error(ckpt, edit):
    # docs/checkpoints.md §1: a corrupt header names the file, never an AttributeError / TypeError
    _edit_header(ckpt, SHARD2, edit)
    with pytest.raises(CheckpointFormatError, match=rf"{SHARD2}: corrupt"):
        load_model(ckpt)


@pytest.mark.parametrize("weight_map", [[1], {"lm_head.weight": 5}])
def test_index_weight_map_wrong_type(ckpt, weight_map):
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError, match=rf"{INDEX_FILE}: not a valid safetensors index"):
        load_model(ckpt)


def _rss_file_mib() -> float:
    """This process's file-backed resident pages (RssFile of /proc/self/status), MiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_read_tensors_do_not_stay_mapped(tmp_path):
    # a bf16 load peaked at 4.7 GiB RSS for 2.2 GiB of weights: every page CheckpointReader read through
    # its file map stayed mapped (file-backed RSS) until close, a second copy of the checkpoint. 16
    # tensors of 4 MiB read one by one: the mapped pages must not add up (before: +64 MiB)
    from m2serve.formats.safetensors_io import CheckpointReader

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(1024, 2048, generator=g).to(torch.bfloat16) for i in range(16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        base = _rss_file_mib()
        for name, want in tensors.items():
            assert torch.equal(reader.read(name), want)  # the copy is the stored tensor
        grown = _rss_file_mib() - base
        assert torch.equal(reader.read("t3", rows=(5, 9)), tensors["t3"][5:9])  # read again after release
    assert grown < 8, f"{grown:.1f} MiB of the file still mapped after reading 64 MiB"
