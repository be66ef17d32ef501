"""``load_model``: config + strict streaming load into a MiniMaxM2ForCausalLM (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from m2serve.config.engine_args import (
    ACTIVATION_QUANT_MODES,
    QUANTIZE_UNQUANTIZED_MODES,
    WEIGHT_DEQUANT_MODES,
    EngineArgs,
)
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.config.parallel import ParallelState
from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.act_quant import ActivationScheme
from m2serve.formats.detect import LinearKind, QuantSpec, checkpoint_quant_config, detect_quant
from m2serve.formats.fp8 import PackedFP8, quantize_fp8_block
from m2serve.formats.loader import (
    LoadPlan,
    ShardPlan,
    iter_weights,
    open_checkpoint,
    read_input_scales,
    read_kv_scales,
)
from m2serve.kernels.build import kernel_backend
from m2serve.kernels.memory import advise_huge_pages
from m2serve.kernels.ops import checkpoint_copy_check, kernels_apply
from m2serve.model.decoder import MiniMaxM2ForCausalLM
from m2serve.model.kernel_choice import choose_kernels
from m2serve.model.linear import Linear


def resolve_weight_dequant(weight_dequant: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``"load"`` or ``"runtime"`` for an EngineArgs.weight_dequant value on ``device`` with ``dtype``
    activations. ``"auto"`` keeps quantised weights as stored (``"runtime"``) on every device but
    the CPU (a GPU holds codes and scales as stored, half the bf16 bytes for FP8, and dequantises
    there, never on the host), and on the CPU where the packed-weight kernels run them
    (m2serve/kernels ``kernels_apply``: bf16/fp32, kernels built — every packed format has one);
    a CPU without them dequantises at load. Raises ValueError naming the field and the accepted
    values for another value."""
    if weight_dequant not in WEIGHT_DEQUANT_MODES:
        raise ValueError(f"weight_dequant={weight_dequant!r} is not supported; "
                         f"use one of {WEIGHT_DEQUANT_MODES}")
    if weight_dequant != "auto":
        return weight_dequant
    if torch.device(device).type != "cpu":
        return "runtime"
    return "runtime" if kernels_apply(device, dtype) else "load"


def quantize_dense_linears(model: torch.nn.Module) -> int:
    """Quantise every :class:`Linear` under ``model`` that holds a dense weight (the linears the
    checkpoint leaves unquantised: attention q/k/v/o and lm_head of the FP4 releases) to FP8 block
    in place (``--quantize-unquantized fp8``, docs/checkpoints.md §6 "Online FP8").

    Per 128x128 block (formats/fp8.py ``quantize_fp8_block``, the official FP8 release's
    convention): ``s = amax / 448`` (1 for an all-zero block), ``q = e4m3(W / s)`` rounded to
    nearest even; the Linear then holds ``weight_q`` e4m3 [out, in] and ``weight_scale_inv`` f32
    [ceil(out/128), ceil(in/128)] exactly as if the checkpoint had shipped them. Quantised one
    128-row scale band at a time, on the weight's device, so the fp32 temporaries are a band's.
    Experts (MiniMaxM2Experts), the router and the embeddings are not Linears and stay as loaded.
    Returns how many linears were quantised; call before ``choose_kernels``."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.packed:
            continue
        w = module.weight
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK), dtype=torch.float32, device=w.device)
        for band, start in enumerate(range(0, n, FP8_BLOCK)):
            q[start:start + FP8_BLOCK], s[band:band + 1] = quantize_fp8_block(w[start:start + FP8_BLOCK])
        module.load(f"{name}.weight", PackedFP8(q, s, f"{name}.weight"))
        count += 1
    return count


def resolve_activation_quant(activation_quant: str, quant: QuantSpec) -> ActivationScheme | None:
    """The input quantisation the quantised linears run (docs/checkpoints.md §9): with ``"auto"`` the
    checkpoint's declared one (``quant.activations``; None = weight-only W4A16), with ``"none"`` None.
    Raises ValueError naming the field and the accepted values for another value, and, under
    ``"auto"``, for a declared input quantisation m2serve cannot reproduce (the reason, and the way
    out: activation_quant none)."""
    if activation_quant not in ACTIVATION_QUANT_MODES:
        raise ValueError(f"activation_quant={activation_quant!r} is not supported; "
                         f"use one of {ACTIVATION_QUANT_MODES}")
    if activation_quant == "none":
        return None
    if quant.activations_unsupported:
        raise ValueError(f"{quant.activations_unsupported}; pass activation_quant none to run the "
                         "weights with unquantised activations (W4A16)")
    return quant.activations


def numerics_banner(args: EngineArgs, config: MiniMaxM2Config) -> str:
    """The banner's (and ``m2serve plan``'s) activations part: which numerics the quantised linears run,
    e.g. ``activations W4A4 MXFP4 (...) (activation_quant auto)`` or ``activations bfloat16
    (activation_quant none)``. ValueError as :func:`resolve_activation_quant`."""
    quant = (detect_quant(*checkpoint_quant_config(Path(config.source).parent, config.quantization_config,
                                                   config.source))
             if config.source.endswith(".json") else detect_quant(config.quantization_config, config.source))
    scheme = resolve_activation_quant(args.activation_quant, quant)
    words = scheme.numerics if scheme else f"{args.dtype}" + (" (W4A16)" if quant.activations else "")
    return f"activations {words} (activation_quant {args.activation_quant})"


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (codes and scales as held): what the
    weights occupy on the device (the planner's ``weight_bytes`` for this rank)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def local_model(model: object) -> torch.nn.Module | None:
    """The model loaded in this process behind an engine's ``model``: itself when it is a module,
    rank 0's module for a multi-rank handle (parallel/worker.py ``DistributedModel.model``), else None."""
    if isinstance(model, torch.nn.Module):
        return model
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def weights_banner(args: EngineArgs, model: torch.nn.Module | None = None) -> str:
    """The start banner's weights part: how quantised weights are held (``weight_dequant`` as given,
    and resolved) and the linear backend in use — on CPU the kernels' backend with its reason (the
    fallback reason when it is ``pytorch``), e.g. ``weights runtime (weight_dequant auto) | CPU linear
    backend: cpu-avx512 (widest ISA this CPU supports; bf16 GEMV up to 4 rows)``. With a loaded
    ``model`` (one process) it adds the implementation picked per module (model/kernel_choice.py
    ``KernelSummary.banner``); serve/cli.py's banner adds the resident bytes
    (:func:`resident_weight_bytes`)."""
    cpu = args.devices.partition(":")[0] == "cpu"
    mode = resolve_weight_dequant(args.weight_dequant, "cpu" if cpu else "cuda", getattr(torch, args.dtype))
    backend = kernel_backend().banner() if cpu else "GPU linear backend: chosen per module after loading"
    line = f"weights {mode} (weight_dequant {args.weight_dequant}) | {backend}"
    summary = getattr(model, "kernel_summary", None)
    if summary is not None:
        line += f" | {summary.banner()}"
    return line


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               parallel: ParallelState | None = None, shard: ShardPlan | None = None,
               progress: bool | None = None, weight_dequant: str = "auto",
               fp8_linear: str = "w8a16", batch_invariant: bool = False,
               activation_quant: str = "auto", quantize_unquantized: str = "none",
               attention_backend: str = "auto") -> MiniMaxM2ForCausalLM:
    """Load a MiniMax-M2 checkpoint directory (BF16 or FP8 block) for inference.

    ``dtype`` is the activation/weight dtype (router stays fp32; FP8 weights are dequantised at
    load, one rounding). ``shard`` is the rank's slice hook (formats/loader.py); with the default
    ParallelState the whole model is loaded. The headers are checked before any data is read
    (CheckpointMismatchError / CheckpointFormatError, both ValueError). Parameters are allocated
    uninitialised and filled tensor by tensor, so peak memory stays near the final size.
    ``model.kv_scales`` holds per-layer (k_scale, v_scale) if the checkpoint ships them, else None.
    ``weight_dequant`` (EngineArgs.weight_dequant): ``"load"`` dequantises every quantised weight
    now; ``"runtime"`` keeps quantised weights as stored — every FP8 block linear, and the FP4
    (NVFP4 / MXFP4) expert weights — and dequantises them when used: a linear per forward, an
    expert only when a step activates it (same values, less memory; other weights as with ``"load"``);
    on CPU with the kernels built they compute straight from the codes (experts through
    ``pack_for_kernels``, done here once). ``"auto"`` (default) picks one of the two for ``device``
    and ``dtype`` (:func:`resolve_weight_dequant`). Raises ValueError for another value.
    ``attention_backend`` (EngineArgs.attention_backend): chosen once, for ``device``, by
    model/attention.py ``resolve_attention_backend`` (ValueError for an unknown name).
    Once loaded, each linear's and expert group's implementation is chosen once
    (model/kernel_choice.py ``choose_kernels``; ``fp8_linear`` = EngineArgs.fp8_linear for GPU
    FP8 linears on the Triton kernel). ``batch_invariant``: load in the batch-invariant mode
    (docs/model.md §7, ``MiniMaxM2ForCausalLM.use_batch_invariant``, applied before the choice);
    ValueError on a device other than the CPU.
    ``activation_quant`` (EngineArgs.activation_quant): ``"auto"`` quantises the input of every
    quantised linear as the checkpoint declares (W4A4, :func:`set_activation_quant`), ``"none"``
    keeps them unquantised (W4A16); ValueError as :func:`resolve_activation_quant`.
    ``quantize_unquantized="fp8"`` (EngineArgs field; default ``"none"``) first quantises the
    linears left dense to FP8 block (:func:`quantize_dense_linears`). Raises ValueError naming the
    field for a ``quantize_unquantized`` value not in QUANTIZE_UNQUANTIZED_MODES.
    """
    if quantize_unquantized not in QUANTIZE_UNQUANTIZED_MODES:
        raise ValueError(f"quantize_unquantized={quantize_unquantized!r} is not supported; "
                         f"use one of {QUANTIZE_UNQUANTIZED_MODES}")
    weight_dequant = resolve_weight_dequant(weight_dequant, device, dtype)
    if batch_invariant and torch.device(device).type != "cpu":
        raise ValueError(f"batch_invariant: implemented for CPU devices only, not {device} "
                         "(docs/model.md §7)")
    cfg = MiniMaxM2Config.from_pretrained(path)
    plan = open_checkpoint(path, cfg, checkpoint_copy_check())
    parallel = parallel or ParallelState()
    with torch.device(device):
        model = MiniMaxM2ForCausalLM(cfg, parallel, dtype, attention_backend)
    advise_huge_pages([*model.parameters(), *model.buffers()])  # before filling (docs/kernels.md §6)
    for layer in model.model.layers:  # bias = 0 unless the file has one (docs/model.md §1 use_routing_bias)
        layer.block_sparse_moe.e_score_correction_bias.data.zero_()
    try:
        for name, tensor in iter_weights(plan, dtype, shard, progress,
                                         packed=weight_dequant == "runtime", device=device):
            model.load_weight(name, tensor)
        model.kv_scales = read_kv_scales(plan)
        set_activation_quant(model, plan, resolve_activation_quant(activation_quant, plan.quant))
    finally:
        plan.reader.close()
    for layer in model.model.layers:
        layer.block_sparse_moe.experts.pack_for_kernels()
    if quantize_unquantized == "fp8":
        quantize_dense_linears(model)
    if batch_invariant:
        model.use_batch_invariant()
    choose_kernels(model, fp8_linear=fp8_linear)
    return model.eval()


_FP4_KINDS = (LinearKind.NVFP4, LinearKind.NVFP4_CT, LinearKind.MXFP4)


def set_activation_quant(model: MiniMaxM2ForCausalLM, plan: LoadPlan,
                         scheme: ActivationScheme | None) -> None:
    """Give every quantised (packed FP4) linear of ``plan`` its input quantisation (docs/checkpoints.md
    §9): the experts of each layer (MiniMaxM2Experts.set_activation_quant) and any other FP4 Linear
    (``Linear.input_quant``); linears the exclude list keeps dense stay unquantised. NVFP4 takes each
    linear's input scale (formats/loader.py ``read_input_scales``), NVFP4_CT its input global scale.
    Raises ValueError when an NVFP4 checkpoint holds no input scale at all, or when a layer mixes FP4
    and other experts."""
    if scheme is None:
        return
    quantised = [name for name, kind in plan.kinds.items() if kind in _FP4_KINDS]
    nvfp4 = scheme in (ActivationScheme.NVFP4, ActivationScheme.NVFP4_CT)
    scales = read_input_scales(plan) if nvfp4 else {}
    if scheme is ActivationScheme.NVFP4_CT:  # compressed-tensors' rules take the global scale itself:
        scales = {n: 1.0 / v for n, v in scales.items()}  # 1 / (1 / g) in float64 rounds back to fp32 g
    if nvfp4 and not scales:
        raise ValueError(f"{plan.reader.path}: {plan.quant.source} declares NVFP4 input activations but the "
                         "checkpoint holds no input_scale / input_global_scale tensor; pass activation_quant "
                         "none to run W4A16")
    for layer_idx, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{layer_idx}.block_sparse_moe.experts."
        experts = [n for n in plan.kinds if n.startswith(prefix)]
        fp4 = [n for n in experts if n in quantised]
        if fp4 and len(fp4) != len(experts):
            raise ValueError(f"layer {layer_idx}: {len(fp4)} of {len(experts)} expert linears are FP4; W4A4 "
                             "needs all or none of a layer's experts quantised (activation_quant none)")
        if fp4:
            layer.block_sparse_moe.experts.set_activation_quant(scheme, {n: scales.get(n) for n in fp4})
    for name in quantised:
        if ".experts." in name:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if not isinstance(module, Linear):
            raise ValueError(f"{name}: W4A4 input quantisation of a quantised non-linear module is not "
                             "supported (activation_quant none)")
        scale = scales.get(name)
        module.input_quant = (scheme, None if scale is None else torch.tensor(scale, dtype=torch.float32,
                                                                                device=module_device(module)))


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first buffer or parameter (cpu when it has none)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")
