"""Grouped SwiGLU experts over an expert range (docs/model.md §3 step 11, precision trap 2).

Legend: T tokens, k top-k, H hidden, E_loc experts held on this rank ([start, start + E_loc)
of the global E), I_loc this rank's intermediate size, R (token, slot) rows (T·k, or the rows an
EP rank received), N rows routed to one expert.

Grouped execution: every (token, slot) row of the layer is sorted by its
local expert (stable), ``offsets`` int32 [E_loc] are the end of each expert's run
(a scatter-add count, then cumsum), and ONE :meth:`MiniMaxM2Experts.grouped_rows` call runs all
experts: ``torch.nn.functional.grouped_mm`` for w13, SwiGLU, ``grouped_mm`` for w2. The number
of dispatched ops does not depend on which or how many experts are hit, and nothing syncs with
the host. Rows whose expert lives on another rank (TP_EP with ``ep_use_allreduce``) are sorted
after the last local expert, past ``offsets[-1]``: grouped_mm skips them (their output rows are
left uninitialised) and the combine zeroes them with a ``where`` (their weight becomes 0), so no
``nonzero`` and no data-dependent shape. The counts use ``scatter_add_`` rather than
``bincount``: bincount sizes its output from max(ids), a host read on CUDA.

``grouped_rows`` is the seam for other weight formats: it takes (rows sorted by expert [R, H],
offsets int32 [E_loc]) and uses the layer's weights in whatever form they are held. Packed
(runtime dequantisation) experts whose kernel choice (made once after loading,
model/kernel_choice.py) is the CPU kernels run ``cpu_grouped_expert_ffn`` straight from the stored
codes: two grouped calls, no host read; FP4 experts with W4A4 inputs run ``cpu_w4a4_expert_ffn``
(the FP4 x FP4 kernels, which quantise the inputs themselves, docs/checkpoints.md §9.1); dense bf16
experts on the CPU take the bf16 kernels over their parameters (BF16 ``PackedWeights``, no copy).
Otherwise (the torch reference: CUDA, fp16, no kernels) it
dequantises the active experts on their device (one host read of the offsets), then grouped_mm.

:meth:`MiniMaxM2Experts.rows_loop` is the previous per-active-expert Python loop (one
:func:`expert_ffn` per expert hit, ``unique_consecutive`` + ``.tolist()``): the test reference,
the fallback where ``grouped_mm`` is missing or does not take the dtype on the device (CUDA
grouped_mm takes bf16 only), and the benchmark-only legacy path (``legacy_path`` on the model,
model/decoder.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.act_quant import ActivationScheme, quantize_activations
from m2serve.formats.fp4 import FP4Scheme, PackedFP4, decode_e8m0
from m2serve.formats.fp8 import PackedFP8, fp8_scale_grid, refine_fp8_grid
from m2serve.kernels.choice import TORCH_CHOICE, KernelChoice, LinearImpl, triton_fused_moe
from m2serve.kernels.ops import (
    FP4_FORMATS,
    KERNEL_K_STEP,
    PackedWeights,
    WeightFormat,
    cpu_grouped_expert_ffn,
    cpu_grouped_linear,
    cpu_w4a4_expert_ffn,
    rowwise_linear,
)

#: W4A4 input quantisation of the expert products: (activations [R, K], 0 = w13's input / 1 = w2's)
#: -> the same activations quantised-dequantised (docs/checkpoints.md §9). None = unquantised.
InputQuant = Callable[[torch.Tensor, int], torch.Tensor]

FP8_SCHEME = "fp8_block"  # MiniMaxM2Experts.scheme of experts held as FP8 block codes


def _scheme_name(scheme: FP4Scheme | str) -> str:
    return scheme.value if isinstance(scheme, FP4Scheme) else scheme


def has_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``F.grouped_mm`` runs for ``dtype`` on ``device`` in this torch: CPU any float dtype
    from torch 2.13 (the first release with the CPU kernel), CUDA bfloat16 (the CUTLASS grouped
    GEMM, SM >= 80; benchmarks/gpu_check.py probes fp32 on the GPU it runs on)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
    return device.type == "cuda" and dtype == torch.bfloat16


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, quant: InputQuant | None = None) -> torch.Tensor:
    """All experts' SwiGLU in two grouped GEMMs: rows [offsets[e-1], offsets[e]) go through expert e.

    x [R, H] act sorted by expert, offsets int32 [E_loc] (end of each expert's rows; rows past
    offsets[-1] are skipped and come back uninitialised), w13 [E_loc, 2·I_loc, H], w2 [E_loc, H,
    I_loc] -> [R, H] act. ``grouped_mm`` takes mat_b as [E, K, N]: the transposed views of the
    [E, N, K] weights (the column-major layout the CUDA kernel wants). ``quant`` (W4A4) quantises
    each product's input first.
    """
    q = quant or _no_quant
    gate, up = F.grouped_mm(q(x, 0), w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)  # [R, I_loc] each
    return F.grouped_mm(q(F.silu(gate) * up, 1), w2.transpose(1, 2), offs=offsets)


def _no_quant(x: torch.Tensor, which: int) -> torch.Tensor:
    return x


def loop_swiglu(x: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                quant: InputQuant | None = None,
                linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """:func:`grouped_swiglu` as a Python loop over the experts (host reads of ``offsets``): the
    fallback where grouped_mm does not run, and with ``linear`` = ``rowwise_linear`` the
    batch-invariant mode's path where the kernels do not run (docs/model.md §7). ``quant`` (W4A4)
    quantises each product's input first. Rows past offsets[-1] are zero."""
    q = quant or _no_quant
    ends = offsets.tolist()
    spans = [(e, s, t) for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends)) if t > s]
    xq = q(x, 0)
    h = x.new_zeros(x.shape[0], w2.shape[2])  # [R, I_loc]
    for e, s, t in spans:
        gate, up = linear(xq[s:t], w13[e]).chunk(2, dim=-1)
        h[s:t] = F.silu(gate) * up
    hq = q(h, 1)
    out = torch.zeros_like(x)
    for e, s, t in spans:
        out[s:t] = linear(hq[s:t], w2[e])
    return out


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               quant: InputQuant | None = None,
               linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """One expert's SwiGLU: ``w2 · (silu(w1·x) ⊙ (w3·x))``.

    x [N, H] act, w13 [2·I_loc, H] (w1 rows then w3 rows), w2 [H, I_loc] -> [N, H] act. ``quant``
    (W4A4, this expert's) quantises each product's input first.
    """
    q = quant or _no_quant
    gate, up = linear(q(x, 0), w13).chunk(2, dim=-1)
    return linear(q(F.silu(gate) * up, 1), w2)


def expert_offsets(key: torch.Tensor, num_experts: int) -> torch.Tensor:
    """key [R] int64 in [0, num_experts] (num_experts = not held here) -> int32 [num_experts]:
    the end of each expert's run once rows are sorted by key (counts by scatter_add_, cumsum)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return counts[:num_experts].cumsum(0).to(torch.int32)


class MiniMaxM2Experts(nn.Module):
    """Experts ``[start, start + E_loc)`` of the global E, intermediate slice of width I_loc.

    Parameters: ``w13`` [E_loc, 2·I_loc, H] (hub w1 rows then w3 rows), ``w2`` [E_loc, H, I_loc].
    Hub tensors are placed with :meth:`load_expert`.

    Runtime dequantisation (``--weight-dequant runtime``, docs/checkpoints.md §6 execution choices):
    when :meth:`load_expert` receives :class:`PackedFP4` or :class:`PackedFP8` weights, the (never
    filled) dense parameters are dropped and the stored codes and scales become buffers
    ``{w1,w3,w2}_q`` — FP4: uint8 [E_loc, N, K/2], ``_s`` [E_loc, N, K/group] (e4m3 or E8M0 bytes),
    ``_s2`` f32 [E_loc] (NVFP4 only); FP8: float8_e4m3fn [E_loc, N, K], ``_s`` f32
    [E_loc, ceil((off + N)/128), ceil(K/128)] for w1 / w3 and [E_loc, ceil(N/128), ceil((off + K)/128)]
    for w2, ``off`` = ``band0``, the offset of this rank's intermediate slice inside its first 128-wide
    band (a TP_TP slice such as 192 of 1,536 may split a band, docs/checkpoints.md §6) — and
    :meth:`grouped_rows` dequantises only the experts a step activates (:meth:`expert_weights`), with
    the same formula (and so the same values) as dequantising at load. :meth:`pack_for_kernels`
    (called once after load) sets ``kernel_weights``
    (w13, w2 as m2serve/kernels' PackedWeights) so that :meth:`grouped_rows` runs the C++ kernels on
    the codes where they apply (same values up to the fp32 summation order), once :meth:`set_choice`
    picked them (model/kernel_choice.py, after loading); until then the torch reference runs.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, start: int, num_local: int,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.start, self.num_local, self.intermediate_size = start, num_local, intermediate_size
        self.hidden_size = hidden_size
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype),
                               requires_grad=False)
        self.act_dtype = self.w13.dtype  # activations (the dense parameters' dtype, kept when packed)
        self.scheme: FP4Scheme | str | None = None  # set when the experts are held packed (FP8_SCHEME)
        self.kernel_weights: tuple[PackedWeights, PackedWeights] | None = None  # pack_for_kernels
        self.batch_invariant = False  # use_batch_invariant (before the kernel choice)
        self.choice: KernelChoice = TORCH_CHOICE  # set_choice, once after loading
        self.act_scheme: ActivationScheme | None = None  # W4A4 inputs (set_activation_quant)
        self.band0 = 0  # FP8: offset of the intermediate slice inside its first 128-wide band (at load)
        self._fused = None  # (fused_moe, (w1, w3, w2) stacks) when the choice is the Triton fused MoE
        self._w4a4_scales = (None, None)  # NVFP4 W4A4 kernels: per-expert input scales (w13's, w2's)

    def weight_format(self) -> WeightFormat | None:
        """The experts' format for the kernel choice (kernels/choice.py): the packed format when
        ``kernel_weights`` are set (:meth:`pack_for_kernels`; BF16 for dense bf16 experts on the CPU),
        else None: other dense experts run grouped_mm, and packed ones without kernel weights the
        dequantising reference."""
        if self.kernel_weights is not None:
            return self.kernel_weights[0].fmt
        return None

    def set_choice(self, choice: KernelChoice) -> None:
        """Run the experts by ``choice`` from now on: the Triton choice runs kernels/triton/moe.py
        ``fused_moe`` on the stored w1 / w3 / w2 (:meth:`forward`, :meth:`rows`). Raises ValueError
        naming the choice when it is the CPU kernels or Triton without ``kernel_weights``
        (:meth:`pack_for_kernels`: experts held as stored), or the CPU kernels without an ISA."""
        if choice.impl in (LinearImpl.CPU_PACKED, LinearImpl.CPU_W4A4) and (
                self.kernel_weights is None or choice.isa is None):
            raise ValueError(f"kernel choice {choice.label}: experts have no kernel weights or ISA")
        if choice.impl is LinearImpl.CPU_W4A4 and self.act_scheme is None:
            raise ValueError(f"kernel choice {choice.label}: the experts' inputs are not quantised (W4A4)")
        if choice.impl is LinearImpl.TRITON and self.kernel_weights is None:
            raise ValueError(f"kernel choice {choice.label}: experts are not held as stored")
        self.choice = choice
        self._fused = None
        self._w4a4_scales = (None, None)
        if choice.impl is LinearImpl.CPU_W4A4 and self.act_scheme is not ActivationScheme.MXFP4:
            # each expert's input scales (w13's, w2's) as the kernel takes them, once
            self._w4a4_scales = (self.input_scale[:, 0].contiguous(), self.input_scale[:, 1].contiguous())
        if choice.impl is LinearImpl.TRITON:  # the launcher and the stacks it reads, once
            self._fused = (triton_fused_moe(), tuple(self._stacked(w) for w in ("w1", "w3", "w2")))

    def load_expert(self, expert: int, which: str, w: torch.Tensor | PackedFP4 | PackedFP8) -> None:
        """Copy hub tensor ``experts.{expert}.{which}.weight`` (global expert id) into place.

        ``w`` is dense, or :class:`PackedFP4` / :class:`PackedFP8` for runtime dequantisation
        (class docstring). Raises ValueError naming the expert and shapes if it is not held here or
        does not fit, or when dense and packed experts (or two schemes) are mixed in one layer.
        """
        e = expert - self.start
        I = self.intermediate_size
        if not 0 <= e < self.num_local:
            raise ValueError(f"expert {expert} is not in this rank's range "
                             f"[{self.start}, {self.start + self.num_local})")
        if isinstance(w, (PackedFP4, PackedFP8)) or self.scheme is not None:
            self._load_packed(expert, which, w)
            return
        dst = {"w1": self.w13.data[e, :I], "w3": self.w13.data[e, I:], "w2": self.w2.data[e]}[which]
        if dst.shape != w.shape:
            raise ValueError(f"expert {expert} {which}: got shape {list(w.shape)}, "
                             f"expected {list(dst.shape)}")
        dst.copy_(w)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                legacy: bool = False) -> torch.Tensor:
        """h [T, H] act, ids [T, k] global expert ids, weights [T, k] f32 -> [T, H] f32.

        Combine: ``Σ_slots w_slot · y_slot`` in fp32 (no cast here; the caller reduces across
        ranks, then casts once). Slots routed to experts outside this rank's range add 0.
        ``legacy`` runs :meth:`forward_loop` (the benchmark-only previous path).
        """
        if legacy:
            return self.forward_loop(h, ids, weights)
        if self.choice.impl is LinearImpl.TRITON:  # kernels/triton/moe.py: sort, w13, w2, weights
            fused_moe, stacks = self._fused
            return fused_moe(h, ids, weights, *stacks, self.start)
        T, k = ids.shape
        E = self.num_local
        local = ids.reshape(-1) - self.start                       # [T·k]
        held = (local >= 0) & (local < E)                          # [T·k] bool
        key = torch.where(held, local, E)                          # other ranks' experts sort last
        order = torch.argsort(key, stable=True)                    # [T·k]
        offsets = expert_offsets(key, E)                           # int32 [E_loc]
        y = self.grouped_rows(h.index_select(0, order // k), offsets)          # [T·k, H] sorted
        y = torch.empty_like(y).index_copy_(0, order, y)           # back to (token, slot) order
        y = torch.where(held[:, None], y, 0.0)                     # not held here: weight 0
        return (y.view(T, k, h.shape[1]).float() * weights[..., None]).sum(1)

    def forward_loop(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` through :meth:`rows_loop` (``nonzero`` of the held slots, a loop over
        the active experts): the previous path, kept as the reference and the legacy switch."""
        T, k = ids.shape
        flat = ids.reshape(-1) - self.start  # [T·k]
        pairs = torch.nonzero((flat >= 0) & (flat < self.num_local)).squeeze(1)
        y = h.new_zeros(T * k, h.shape[1])  # [T·k, H] act
        y[pairs] = self.rows_loop(h[pairs // k], flat[pairs])
        return (y.view(T, k, h.shape[1]).float() * weights[..., None]).sum(1)

    def rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """x [R, H] act, local_ids [R] int64 in [0, E_loc) -> [R, H] act: row r through expert
        ``start + local_ids[r]``, grouped (the receiving side of the EP exchange,
        model/collectives.py)."""
        if self.choice.impl is LinearImpl.TRITON:  # each row one slot of weight 1
            fused_moe, stacks = self._fused
            ones = torch.ones(local_ids.shape[0], 1, dtype=torch.float32, device=x.device)
            return fused_moe(x, local_ids[:, None], ones, *stacks, 0).to(x.dtype)
        order = torch.argsort(local_ids, stable=True)
        y = self.grouped_rows(x.index_select(0, order), expert_offsets(local_ids, self.num_local))
        return torch.empty_like(y).index_copy_(0, order, y)

    def grouped_rows(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """THE grouped-expert seam: x [R, H] act sorted by local expert, offsets int32 [E_loc]
        (end of each expert's rows; rows past offsets[-1] are not computed) -> [R, H] act.

        Experts whose ``choice`` is the CPU kernels (made once after loading: ``kernel_weights`` set —
        packed experts, or dense bf16 ones on the CPU — bf16/fp32 activations, kernels built):
        ``cpu_grouped_expert_ffn`` on the stored codes, no host read (rows past offsets[-1] come back
        0). Other dense experts: :func:`grouped_swiglu` on the parameters, no host read. Other packed
        experts (the torch reference): the offsets are read on the host once (the layer's one sync
        in that case) and only the ACTIVE experts are dequantised (on their device),
        stacked and run by grouped_mm with their offsets (dequantising all E_loc would hold every
        expert dense at once). :func:`loop_swiglu` where grouped_mm does not run (:func:`has_grouped_mm`).
        """
        if self.choice.impl is LinearImpl.CPU_W4A4:  # FP4 x FP4: the kernels quantise the inputs
            return cpu_w4a4_expert_ffn(x, offsets, *self.kernel_weights, self.choice.isa, self._w4a4_scales,
                                       self.act_scheme)
        quant = self.input_quant(offsets)
        if self.choice.impl is LinearImpl.CPU_PACKED:
            isa, invariant, rows = self.choice.isa, self.batch_invariant, self.choice.gemv_rows
            if quant is None:
                return cpu_grouped_expert_ffn(x, offsets, *self.kernel_weights, isa, invariant, rows)
            w13, w2 = self.kernel_weights
            gate, up = cpu_grouped_linear(quant(x, 0), offsets, w13, isa, invariant, rows).chunk(2, dim=-1)
            return cpu_grouped_linear(quant(F.silu(gate) * up, 1), offsets, w2, isa, invariant, rows)
        if self.scheme is None:
            w13, w2 = self.w13, self.w2
        else:
            ends = offsets.tolist()
            active = [e for e in range(self.num_local) if ends[e] > (ends[e - 1] if e else 0)]
            if not active:
                return torch.zeros_like(x)
            pairs = [self.expert_weights(e, x.dtype) for e in active]
            w13, w2 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            offsets = torch.tensor([ends[e] for e in active], dtype=torch.int32, device=x.device)
        if self.batch_invariant:
            return loop_swiglu(x, offsets, w13, w2, quant, rowwise_linear)
        if has_grouped_mm(x.dtype, x.device):
            return grouped_swiglu(x, offsets, w13, w2, quant)
        return loop_swiglu(x, offsets, w13, w2, quant)

    def set_activation_quant(self, scheme: ActivationScheme, input_scales: dict[str, float | None]) -> None:
        """Quantise the input of every expert product (W4A4, docs/checkpoints.md §9) with ``scheme``.
        NVFP4: ``input_scales`` maps hub names (``...experts.E.w1.weight``) to each linear's input
        scale (NVFP4_CT: its input global scale); this rank keeps its experts' as ``input_scale`` f32
        [E_loc, 2] (w13's input, w2's).
        Raises ValueError naming both tensors when an expert's w1 and w3 scales differ (they share
        one input), or naming the tensor when one is missing."""
        self.act_scheme = scheme
        if scheme not in (ActivationScheme.NVFP4, ActivationScheme.NVFP4_CT):
            return
        by_expert: dict[tuple[int, str], float] = {}
        for name, value in input_scales.items():
            parts = name.split(".")
            expert, which = int(parts[parts.index("experts") + 1]), parts[parts.index("experts") + 2]
            if value is None:
                raise ValueError(f"{name}: no input scale for an NVFP4 W4A4 linear")
            by_expert[expert, which] = value
        table = torch.empty(self.num_local, 2, dtype=torch.float32)
        for e in range(self.num_local):
            g = self.start + e
            w1, w3, w2 = (by_expert[g, w] for w in ("w1", "w3", "w2"))
            if w1 != w3:
                raise ValueError(f"experts.{g}.w1.input_scale {w1} != experts.{g}.w3.input_scale {w3}: "
                                 "w1 and w3 share one input, W4A4 needs one scale for it "
                                 "(activation_quant none)")
            table[e, 0], table[e, 1] = w1, w2
        self.register_buffer("input_scale", table.to(self._device()))

    def _device(self) -> torch.device:
        return next(iter((*self.parameters(), *self.buffers()))).device

    def input_quant(self, offsets: torch.Tensor, expert: int | None = None) -> InputQuant | None:
        """The W4A4 quantisation of this layer's expert inputs (None when unquantised): rows sorted by
        expert with ``offsets`` int32 [E_loc] (each row quantised with its expert's NVFP4 input scale,
        found on the device by ``searchsorted``, no host read), or all rows of local ``expert``."""
        scheme = self.act_scheme
        if scheme is None:
            return None
        if scheme is ActivationScheme.MXFP4:
            return lambda t, which: quantize_activations(t, scheme)
        if expert is not None:
            return lambda t, which: quantize_activations(t, scheme, self.input_scale[expert, which])

        def nvfp4(t: torch.Tensor, which: int) -> torch.Tensor:
            rows = torch.arange(t.shape[0], dtype=offsets.dtype, device=t.device)
            e = torch.searchsorted(offsets, rows, right=True).clamp(max=self.num_local - 1)  # [R]
            return quantize_activations(t, scheme, self.input_scale[e, which, None])
        return nvfp4

    def use_batch_invariant(self) -> None:
        """Switch to the batch-invariant mode (docs/model.md §7), once after load: :meth:`grouped_rows`
        keeps every row on the kernels' GEMV path (dense bf16 experts too: ``kernel_weights`` become
        bf16 views of the parameters, no copy), or where the kernels do not run, loops over the
        active experts with one GEMV per row (``rowwise_linear``). Slower for many rows per expert
        (the weights are read once per 8 rows instead of once per GEMM tile)."""
        self.batch_invariant = True
        if self.kernel_weights is None and self.scheme is None and self.w13.dtype == torch.bfloat16:
            self.kernel_weights = (PackedWeights(WeightFormat.BF16, self.w13.data),
                                   PackedWeights(WeightFormat.BF16, self.w2.data))

    def pack_for_kernels(self) -> None:
        """Once all experts are loaded: ``kernel_weights`` = (w13 [E_loc, 2·I_loc, H] with w1 rows then
        w3 rows, w2 [E_loc, H, I_loc]) as :class:`PackedWeights` over the stored codes. w13 is one
        concatenated copy and the ``w1_*`` / ``w3_*`` buffers become views of it, so nothing is held
        twice (NVFP4 adds a per-row f32 ``scale_2`` [E_loc, 2·I_loc]). Dense bf16 experts on the CPU
        get BF16 ``PackedWeights`` over the parameters themselves (no copy): the kernels' GEMV reads
        each active expert's weights once per step where ``grouped_mm`` ran one GEMM per expert
        (docs/kernels.md §6); other dense experts (fp32, or on a GPU) keep ``kernel_weights`` None.
        FP8 experts whose I slice splits a 128-row band or is not whole bands
        (a w1 block would straddle w3) get ``kernel_weights`` on a finer scale grid (:meth:`_stacked`;
        the stored ``_s`` buffers stay as they are), or None where that grid is not one the kernels
        decode (the dequantising path)."""
        I = self.intermediate_size
        if self.scheme is None and self.w13.dtype == torch.bfloat16 and self.w13.device.type == "cpu":
            self.kernel_weights = (PackedWeights(WeightFormat.BF16, self.w13.data),
                                   PackedWeights(WeightFormat.BF16, self.w2.data))
            return
        if self.scheme is None:
            return
        stacks = [self._stacked(which) for which in ("w1", "w3", "w2")]
        if any(w is None for w in stacks):
            return
        w1, w3, w2 = stacks
        w13 = PackedWeights.concat_rows([w1, w3])
        split = w1.scale.shape[1]  # scale rows of w1: I / 128 (FP8) or I (FP4)
        self.w1_q, self.w3_q = w13.q[:, :I], w13.q[:, I:]
        if not self._refined():
            self.w1_s, self.w3_s = w13.scale[:, :split], w13.scale[:, split:]
        self.kernel_weights = (w13, w2)

    def _refined(self) -> bool:
        """FP8 experts whose slice is not whole 128-wide bands from a band start (kernels then take a
        finer scale grid, formats/fp8.py ``refine_fp8_grid``)."""
        return self.scheme == FP8_SCHEME and bool(self.band0 or self.intermediate_size % FP8_BLOCK)

    def _stacked(self, which: str) -> PackedWeights | None:
        """The buffers of ``which`` (w1 / w3 / w2) for all local experts as kernel PackedWeights (no copy
        of the codes). FP8 experts whose I slice splits a band or is not whole bands
        (:meth:`_refined`) get their scales on the grid b = gcd(128, band0, I_loc) along I (rows of
        w1 / w3, columns of w2; 64 for 192 of 1,536) from formats/fp8.py ``refine_fp8_grid``, a new
        tensor the size of the stored scales times 128/b; None when b is not a multiple of 16."""
        q, s = getattr(self, f"{which}_q"), getattr(self, f"{which}_s")
        if self.scheme == FP8_SCHEME:
            if not self._refined():
                return PackedWeights(WeightFormat.FP8_BLOCK, q, s, None, FP8_BLOCK, FP8_BLOCK)
            b = math.gcd(FP8_BLOCK, self.band0, self.intermediate_size)
            if b % KERNEL_K_STEP:
                return None
            n, k = q.shape[1:]
            if which == "w2":
                s, bn, bk = refine_fp8_grid(s, n, k, 0, self.band0, block_k=b)
            else:
                s, bn, bk = refine_fp8_grid(s, n, k, self.band0, 0, block_n=b)
            return PackedWeights(WeightFormat.FP8_BLOCK, q, s, None, bn, bk)
        s2 = None if self.scheme is FP4Scheme.MXFP4 else getattr(self, f"{which}_s2")
        return PackedWeights(FP4_FORMATS[self.scheme], q, s, s2, 1, self.scheme.group)

    def rows_loop(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`rows` as the previous loop: one :func:`expert_ffn` per ACTIVE expert
        (``unique_consecutive`` and ``.tolist()``: host syncs; packed experts dequantised one by
        one). The reference of the grouped path and the legacy switch's path."""
        order = torch.argsort(local_ids, stable=True)
        experts, counts = torch.unique_consecutive(local_ids[order], return_counts=True)
        out = torch.empty_like(x)
        s = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            sel = order[s: s + c]
            w13, w2 = self.expert_weights(e, x.dtype)
            quant = self.input_quant(offsets=None, expert=e)
            out[sel] = expert_ffn(x[sel], w13, w2) if quant is None else expert_ffn(x[sel], w13, w2, quant)
            s += c
        return out

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``e``'s (w13 [2·I_loc, H], w2 [H, I_loc]) in ``dtype``: the parameters'
        views, or a fresh dequantisation of the packed buffers (runtime mode)."""
        if self.scheme is None:
            return self.w13[e], self.w2[e]
        w1, w3, w2 = (self._packed(which, e).dequantize(dtype) for which in ("w1", "w3", "w2"))
        return torch.cat([w1, w3]), w2

    def _packed(self, which: str, e: int) -> PackedFP4 | PackedFP8:
        name = f"experts.{self.start + e}.{which}.weight"
        if self.scheme == FP8_SCHEME:
            off = (0, self.band0) if which == "w2" else (self.band0, 0)
            return PackedFP8(getattr(self, f"{which}_q")[e], getattr(self, f"{which}_s")[e], name, *off)
        s2 = getattr(self, f"{which}_s2")[e] if self.scheme is not FP4Scheme.MXFP4 else None
        return PackedFP4(self.scheme, getattr(self, f"{which}_q")[e], getattr(self, f"{which}_s")[e], s2,
                         f"experts.{self.start + e}.{which}.weight")

    def _load_packed(self, expert: int, which: str, w: torch.Tensor | PackedFP4 | PackedFP8) -> None:
        if not isinstance(w, (PackedFP4, PackedFP8)):
            raise ValueError(f"expert {expert} {which}: dense weight for experts held packed "
                             f"({_scheme_name(self.scheme)}); mixed storage in one layer is not supported")
        scheme = FP8_SCHEME if isinstance(w, PackedFP8) else w.scheme
        band0 = (w.col0 if which == "w2" else w.row0) if isinstance(w, PackedFP8) else 0
        if self.scheme is None:
            self._to_packed(scheme, band0)
        elif scheme != self.scheme:
            raise ValueError(f"expert {expert} {which}: {_scheme_name(scheme)} weight for experts held as "
                             f"{_scheme_name(self.scheme)}")
        H, I = self.hidden_size, self.intermediate_size
        want = (H, I) if which == "w2" else (I, H)
        if w.shape != want:
            raise ValueError(f"expert {expert} {which}: got shape {list(w.shape)}, expected {list(want)}")
        if isinstance(w, PackedFP8) and ((w.row0, w.col0) != ((0, band0) if which == "w2" else (band0, 0))
                                         or band0 != self.band0):
            raise ValueError(f"expert {expert} {which}: FP8 slice at row0 {w.row0}, col0 {w.col0}; this "
                             f"rank's intermediate slice starts {self.band0} into its 128-wide band")
        if self.scheme is FP4Scheme.MXFP4:
            decode_e8m0(w.scale, f"{w.name}_scale")  # reject NaN codes now, not mid-request
        e = expert - self.start
        dst_s = getattr(self, f"{which}_s")[e]
        if dst_s.shape != w.scale.shape:
            raise ValueError(f"expert {expert} {which}: scale shape {list(w.scale.shape)}, "
                             f"expected {list(dst_s.shape)}")
        getattr(self, f"{which}_q")[e].copy_(w.q if isinstance(w, PackedFP8) else w.packed)
        dst_s.copy_(w.scale)
        if isinstance(w, PackedFP4) and w.scale_2 is not None:
            getattr(self, f"{which}_s2")[e] = w.scale_2.reshape(())

    def _to_packed(self, scheme: FP4Scheme | str, band0: int = 0) -> None:
        """Replace the dense parameters (allocated, never filled) by packed buffers; ``band0``: FP8
        slice offset along I (class docstring)."""
        E, H, I, device = self.num_local, self.w2.shape[1], self.intermediate_size, self.w2.device
        del self.w13, self.w2
        if scheme == FP8_SCHEME:
            self.band0 = band0
            for which, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                self.register_buffer(f"{which}_q",
                                     torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=device))
                off = (0, band0) if which == "w2" else (band0, 0)
                self.register_buffer(f"{which}_s", torch.empty(E, *fp8_scale_grid(n, k, *off),
                                                               dtype=torch.float32, device=device))
            self.scheme = scheme
            return
        g = scheme.group
        scale_dtype = torch.uint8 if scheme is FP4Scheme.MXFP4 else torch.float8_e4m3fn
        for which, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            self.register_buffer(f"{which}_q", torch.empty(E, n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{which}_s", torch.empty(E, n, k // g, dtype=scale_dtype, device=device))
            if scheme is not FP4Scheme.MXFP4:
                self.register_buffer(f"{which}_s2", torch.empty(E, dtype=torch.float32, device=device))
        self.scheme = scheme
