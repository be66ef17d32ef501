"""Speculative decoding: the n-gram (prompt lookup) proposer and the two acceptance rules
(docs/serving.md §13).

* :func:`propose_ngram` drafts up to K tokens by finding the sequence's last n tokens earlier in the
  sequence (prompt + output) and copying what followed them; a pure function of the token list that
  scans the sequence (the oracle).
* :class:`NgramIndex` gives the same drafts from a per-request index (n-gram -> its latest end),
  updated with the tokens appended since the last call: the engine's proposer, O(b - a + 1) dict
  operations per new token and per step instead of a scan.
* :func:`accepted_length` is the engine's rule for a deterministic draft: the target samples every
  verified position itself (the same uniform, keyed by seed and output position, as plain decoding
  would use there), and a drafted token is accepted iff it equals the target's own sample, so the
  output is token for token the plain decoding's (docs/serving.md §13, the proof).
* :func:`rejection_sample` is the standard rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023)
  for drafts that carry their own distribution q (a draft model, EAGLE): accept token x with
  probability min(1, p(x) / q(x)), else draw from norm(max(0, p - q)); every output token is then
  distributed as p. Not used by the n-gram path; :func:`rejection_sample_batched` is the same rule
  for many requests at once on their device (the EAGLE-3 verification, docs/serving.md §14).

Legend: K drafted tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Keys xor-ed into a request's seed for the EAGLE-3 streams of counter-based uniforms
#: (engine/sampling.py ``counter_uniforms``, docs/serving.md §14): the draft's draws and the
#: rejection rule's acceptance tests; the residual / bonus draw uses the request's own stream,
#: at the output position, as plain decoding's draw there.
DRAFT_STREAM = 0x5EED_D4AF_7000_0001
ACCEPT_STREAM = 0x5EED_ACCE_9700_0002


def stream_seed(seed: int, key: int) -> int:
    """The int64 (two's complement) seed of the stream ``key`` of a request seeded ``seed``:
    ``(seed xor key) mod 2**64`` as counter_uniforms takes it."""
    z = (seed ^ key) % 2 ** 64
    return z - 2 ** 64 if z >= 2 ** 63 else z


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` drafted tokens for a sequence ``token_ids`` (prompt + output so far).

    For n from ``max_n`` down to ``min_n`` (the longest match wins): the last n tokens are the
    pattern; its most recent earlier occurrence (one that starts before len - n) is the match, and
    the draft is the (at most k) tokens that follow that occurrence (fewer when the sequence ends
    first). No match of any length, or ``k`` <= 0: []. docs/serving.md §13.
    """
    L = len(token_ids)
    if k <= 0 or L < 2:
        return []
    toks = list(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = toks[L - n:]
        last = pattern[-1]
        # candidate ends e (exclusive) of an earlier occurrence: toks[e - n:e] == pattern, e < L
        for e in range(L - 1, n - 1, -1):
            if toks[e - 1] == last and toks[e - n:e] == pattern:
                return toks[e:e + k]
    return []


class NgramIndex:
    """Incremental prompt lookup for one request: ``propose(token_ids, k)`` returns exactly
    ``propose_ngram(token_ids, k, min_n, max_n)`` (docs/serving.md §13, "Proposer").

    For every n in [min_n, max_n] a dict maps each n-gram (a tuple of n token ids) to the largest end
    e (exclusive) of its occurrences ``token_ids[e - n:e]`` with e < len(token_ids): the n-grams that
    end before the sequence's last token are indexed, so the lookup of the last n tokens finds their
    most recent *earlier* occurrence, as the scan does. The token list must only grow between calls
    (``Request.all_token_ids`` does; a shorter one rebuilds the index). Cost per call: the tokens
    appended since the last call times (max_n - min_n + 1) dict writes, plus max_n - min_n + 1
    lookups; the first call indexes the prompt. Memory: max_n - min_n + 1 dict entries per token.
    """

    __slots__ = ("min_n", "max_n", "_tables", "_indexed")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramIndex: need 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0   # every n-gram ending at e < _indexed is in the tables

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafted tokens for ``token_ids`` (prompt + output so far); see the class."""
        L = len(token_ids)
        if k <= 0 or L < 2:
            return []
        if L < self._indexed:   # not the list it indexed: start again
            self._tables = [{} for _ in self._tables]
            self._indexed = 0
        lo = self.min_n
        if L - self._indexed <= 8:   # a step's few new tokens: plain writes, in end order
            for e in range(max(self._indexed, lo), L):   # ends e <= L - 1: the n-grams before the last
                for n in range(lo, min(self.max_n, e) + 1):
                    self._tables[n - lo][tuple(token_ids[e - n:e])] = e
        else:   # the prompt: one update per n; tuples in end order, so a later end overwrites
            for n, table in enumerate(self._tables, lo):
                e0 = max(self._indexed, n)
                if e0 < L:
                    span = token_ids[e0 - n:L - 1]
                    table.update(zip(zip(*(span[i:] for i in range(n))), range(e0, L)))
        self._indexed = L
        for n in range(min(self.max_n, L - 1), lo - 1, -1):
            e = self._tables[n - lo].get(tuple(token_ids[L - n:]))
            if e is not None:
                return list(token_ids[e:e + k])
        return []


def accepted_length(draft_token_ids: Sequence[int], sampled_token_ids: Sequence[int]) -> int:
    """How many leading drafted tokens the target accepts: the largest a with
    ``sampled_token_ids[i] == draft_token_ids[i]`` for every i < a (sample i is the target's own
    draw at the position of draft i, docs/serving.md §13). The request then emits
    ``sampled_token_ids[:a + 1]``: the a accepted drafts and the target's token after them.
    Raises ValueError unless there is one more sample than drafts."""
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"accepted_length: {len(sampled_token_ids)} samples for {len(draft_token_ids)} "
                         "drafts; verification samples K + 1 positions")
    a = 0
    while a < len(draft_token_ids) and sampled_token_ids[a] == draft_token_ids[a]:
        a += 1
    return a


def _inverse_cdf(w: torch.Tensor, u: float) -> int:
    """First token id whose cumulative weight exceeds u · total (w [V] >= 0, total > 0)."""
    cdf = w.double().cumsum(0)
    target = torch.tensor([u], dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, target, right=True).clamp(max=w.numel() - 1))


def rejection_sample(draft_token_ids: Sequence[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     accept_uniforms: Sequence[float], resample_uniforms: Sequence[float]) -> list[int]:
    """The standard speculative-sampling rule (Leviathan et al. 2023, Algorithm 1) for K drafted
    tokens that carry their own distribution; returns the emitted tokens (the accepted drafts, then
    one more: the residual draw at the first rejection, or the bonus draw after K acceptances).

    draft_token_ids: [K] the drafted ids; draft_probs: f32/f64 [K, V], q_i (row i drafted token i);
    target_probs: [K + 1, V], p_i (row K: the target's distribution after all K drafts);
    accept_uniforms: K numbers in [0, 1): draft i is accepted iff u_i < p_i(x_i) / q_i(x_i) (i.e. with
    probability min(1, p/q)); resample_uniforms: K + 1 numbers in [0, 1): at the first rejection i the
    token is drawn by inverse CDF over token ids from norm(max(0, p_i - q_i)) (p_i itself when that
    is all zero), after K acceptances from p_K. Raises ValueError on mismatched shapes or a drafted
    token with q = 0 (a draft cannot propose a token its own distribution excludes).
    """
    K = len(draft_token_ids)
    if draft_probs.dim() != 2 or draft_probs.shape[0] != K or target_probs.dim() != 2 \
            or target_probs.shape[0] != K + 1 or target_probs.shape[1] != draft_probs.shape[1]:
        raise ValueError(f"rejection_sample: draft_probs {tuple(draft_probs.shape)} must be [K, V] and "
                         f"target_probs {tuple(target_probs.shape)} [K + 1, V] for K = {K}")
    if len(accept_uniforms) != K or len(resample_uniforms) != K + 1:
        raise ValueError(f"rejection_sample: needs K = {K} accept uniforms and K + 1 resample uniforms")
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        q, p = float(draft_probs[i, x]), float(target_probs[i, x])
        if q <= 0:
            raise ValueError(f"rejection_sample: draft {i} (token {x}) has draft probability 0")
        if accept_uniforms[i] < p / q:
            out.append(int(x))
            continue
        residual = (target_probs[i].double() - draft_probs[i].double()).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = target_probs[i].double()
        out.append(_inverse_cdf(residual, resample_uniforms[i]))
        return out
    out.append(_inverse_cdf(target_probs[K], resample_uniforms[K]))
    return out


def rejection_sample_batched(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                             draft_probs: torch.Tensor, target_probs: torch.Tensor,
                             accept_uniforms: torch.Tensor, resample_uniforms: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample` for B requests at once, on their device, no host sync (the engine's
    EAGLE-3 verification, docs/serving.md §14; :func:`rejection_sample` is its oracle).

    draft_token_ids int64 [B, K] (padding any id past num_drafts); num_drafts int64 [B], k_b <= K;
    draft_probs [B, K, V] q; target_probs [B, K + 1, V] p; accept_uniforms [B, K]; resample_uniforms
    [B, K + 1]. Row b: its first k_b drafts are tested as in :func:`rejection_sample` (accept iff
    u < p(x) / q(x)); a_b = the accepted count; the last token is drawn by inverse CDF (float64)
    from norm(max(0, p_a - q_a)) (p_a when that is all zero) when a_b < k_b, else from p_{k_b}, with
    resample_uniforms[b, a_b]. Returns (a [B] int64, last token [B] int64): the request emits its
    first a_b drafts and that token. Raises ValueError for mismatched shapes."""
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    if (tuple(draft_probs.shape) != (B, K, V) or tuple(target_probs.shape) != (B, K + 1, V)
            or tuple(accept_uniforms.shape) != (B, K) or tuple(resample_uniforms.shape) != (B, K + 1)
            or tuple(num_drafts.shape) != (B,)):
        raise ValueError(f"rejection_sample_batched: drafts {tuple(draft_token_ids.shape)}, q "
                         f"{tuple(draft_probs.shape)}, p {tuple(target_probs.shape)}, uniforms "
                         f"{tuple(accept_uniforms.shape)} / {tuple(resample_uniforms.shape)}, num_drafts "
                         f"{tuple(num_drafts.shape)}: need [B, K], [B, K, V], [B, K + 1, V], [B, K], "
                         "[B, K + 1], [B]")
    p = target_probs.double()
    q = draft_probs.double()
    x = draft_token_ids.unsqueeze(-1)
    px, qx = p[:, :K].gather(2, x).squeeze(-1), q.gather(2, x).squeeze(-1)                    # [B, K]
    valid = torch.arange(K, device=p.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    accept = (accept_uniforms.double() < px / qx) & valid   # padding's 0 / 0 is masked
    a = accept.long().cumprod(1).sum(1)                                                        # [B]
    pa = p.gather(1, a.view(B, 1, 1).expand(B, 1, V)).squeeze(1)                               # [B, V]
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], 1)
    qa = q_pad.gather(1, a.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    rejected = (a < num_drafts).unsqueeze(1)
    w = torch.where(rejected, (pa - qa).clamp(min=0), pa)
    w = torch.where(w.sum(1, keepdim=True) > 0, w, pa)
    cdf = w.cumsum(1)
    u = resample_uniforms.double().gather(1, a.view(B, 1))
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=V - 1).squeeze(1)
    return a, token
