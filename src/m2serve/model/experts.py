"""Grouped SwiGLU experts over an expert range (docs/model.md §3 step 11, precision trap 2).

Legend: T tokens, k top-k, H hidden, E_loc experts held on this rank ([start, start + E_loc)
of the global E), I_loc this rank's intermediate size, N pairs routed to one expert.

(token, expert) pairs are sorted by expert and each ACTIVE expert runs one
:func:`expert_ffn` on its gathered tokens: no loop over all experts, no dense product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m2serve.config.quant import FP8_BLOCK
from m2serve.formats.fp4 import FP4Scheme, PackedFP4, decode_e8m0
from m2serve.formats.fp8 import PackedFP8

FP8_SCHEME = "fp8_block"  # MiniMaxM2Experts.scheme of experts held as FP8 block codes


def _scheme_name(scheme: FP4Scheme | str) -> str:
    return scheme.value if isinstance(scheme, FP4Scheme) else scheme


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: ``w2 · (silu(w1·x) ⊙ (w3·x))``.

    x [N, H] act, w13 [2·I_loc, H] (w1 rows then w3 rows), w2 [H, I_loc] -> [N, H] act.
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class MiniMaxM2Experts(nn.Module):
    """Experts ``[start, start + E_loc)`` of the global E, intermediate slice of width I_loc.

    Parameters: ``w13`` [E_loc, 2·I_loc, H] (hub w1 rows then w3 rows), ``w2`` [E_loc, H, I_loc].
    Hub tensors are placed with :meth:`load_expert`.

    Runtime dequantisation (``--weight-dequant runtime``, docs/checkpoints.md §6 execution choices):
    when :meth:`load_expert` receives :class:`PackedFP4` or :class:`PackedFP8` weights, the (never
    filled) dense parameters are dropped and the stored codes and scales become buffers
    ``{w1,w3,w2}_q`` — FP4: uint8 [E_loc, N, K/2], ``_s`` [E_loc, N, K/group] (e4m3 or E8M0 bytes),
    ``_s2`` f32 [E_loc] (NVFP4 only); FP8: float8_e4m3fn [E_loc, N, K], ``_s`` f32
    [E_loc, ceil(N/128), ceil(K/128)] — and :meth:`expert_weights` dequantises only the experts a
    step activates, with the same formula (and so the same values) as dequantising at load.
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
        self.scheme: FP4Scheme | str | None = None  # set when the experts are held packed (FP8_SCHEME)

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

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H] act, ids [T, k] global expert ids, weights [T, k] f32 -> [T, H] f32.

        Combine: ``Σ_slots w_slot · y_slot`` in fp32 (no cast here; the caller reduces across
        ranks, then casts once). Slots routed to experts outside this rank's range add 0.
        """
        T, k = ids.shape
        flat = ids.reshape(-1) - self.start  # [T·k]
        pairs = torch.nonzero((flat >= 0) & (flat < self.num_local)).squeeze(1)
        y = h.new_zeros(T * k, h.shape[1])  # [T·k, H] act
        y[pairs] = self.rows(h[pairs // k], flat[pairs])
        return (y.view(T, k, h.shape[1]).float() * weights[..., None]).sum(1)

    def rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H] act, local_ids [N] int64 in [0, E_loc) -> [N, H] act: row n through expert
        ``start + local_ids[n]``; rows grouped by expert, one :func:`expert_ffn` per ACTIVE expert
        (also the receiving side of the EP exchange, model/collectives.py)."""
        order = torch.argsort(local_ids, stable=True)
        experts, counts = torch.unique_consecutive(local_ids[order], return_counts=True)
        out = torch.empty_like(x)
        s = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            sel = order[s: s + c]
            w13, w2 = self.expert_weights(e, x.dtype)
            out[sel] = expert_ffn(x[sel], w13, w2)
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
            return PackedFP8(getattr(self, f"{which}_q")[e], getattr(self, f"{which}_s")[e], name)
        s2 = getattr(self, f"{which}_s2")[e] if self.scheme is not FP4Scheme.MXFP4 else None
        return PackedFP4(self.scheme, getattr(self, f"{which}_q")[e], getattr(self, f"{which}_s")[e], s2,
                         f"experts.{self.start + e}.{which}.weight")

    def _load_packed(self, expert: int, which: str, w: torch.Tensor | PackedFP4 | PackedFP8) -> None:
        if not isinstance(w, (PackedFP4, PackedFP8)):
            raise ValueError(f"expert {expert} {which}: dense weight for experts held packed "
                             f"({_scheme_name(self.scheme)}); mixed storage in one layer is not supported")
        scheme = FP8_SCHEME if isinstance(w, PackedFP8) else w.scheme
        if self.scheme is None:
            self._to_packed(scheme)
        elif scheme != self.scheme:
            raise ValueError(f"expert {expert} {which}: {_scheme_name(scheme)} weight for experts held as "
                             f"{_scheme_name(self.scheme)}")
        H, I = self.hidden_size, self.intermediate_size
        want = (H, I) if which == "w2" else (I, H)
        if w.shape != want:
            raise ValueError(f"expert {expert} {which}: got shape {list(w.shape)}, expected {list(want)}")
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

    def _to_packed(self, scheme: FP4Scheme | str) -> None:
        """Replace the dense parameters (allocated, never filled) by packed buffers."""
        E, H, I, device = self.num_local, self.w2.shape[1], self.intermediate_size, self.w2.device
        del self.w13, self.w2
        if scheme == FP8_SCHEME:
            for which, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                self.register_buffer(f"{which}_q",
                                     torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=device))
                self.register_buffer(f"{which}_s", torch.empty(E, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK),
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
