"""Sampler tests (docs/serving.md §10: penalties -> temperature -> top-k -> top-p -> min-p -> draw).

Every expected value is derived by hand in the test from the fixed logits (math module only), never
recorded from the sampler. The returned logprobs are those of the distribution the token was drawn
from, so they expose the mask: filtered tokens are absent from the top list. ``sample`` is pure:
the post-model update (tokens appended, penalties counted, reasoning state, finish) is
``Scheduler.update_from_output``'s and is tested in test_scheduler.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from m2serve.config.model_config import GenerationDefaults
from m2serve.engine.sampling import (
    MAX_LOGPROBS,
    PenaltyState,
    SamplerOutput,
    SamplingBatch,
    SamplingParams,
    SamplingState,
    apply_allowed_bitmask,
    compute_logprobs,
    counter_uniforms,
)
from m2serve.engine.sampling import sample as sample_batch

NO_DEFAULTS = GenerationDefaults()
MINIMAX = GenerationDefaults(temperature=1.0, top_p=0.95, top_k=40)  # docs/model.md §1


@dataclass
class Row:
    """One request as the sampler sees it: its state, prompt and output tokens so far."""

    state: SamplingState
    prompt: list[int]
    output: list[int] = field(default_factory=list)


def state(prompt=(), eos=(), output=(), generator=None, **kw) -> Row:
    """A row with resolved params (temperature 1, top_p 1, top_k off unless given)."""
    st = SamplingState.new(SamplingParams(**kw).resolved(NO_DEFAULTS), eos, generator)
    return Row(st, list(prompt), list(output))


def sample(logits: torch.Tensor, rows: list[Row], allowed: torch.Tensor | None = None) -> SamplerOutput:
    """The engine's sampler call: penalty rows holding each row's prompt and output, the step's
    SamplingBatch (output position = tokens so far), then the pure sampler."""
    pen = PenaltyState(logits.shape[1])
    for r in rows:
        r.state.penalty_row = pen.add(r.prompt, r.output) if r.state.needs_penalties else 0
    batch = SamplingBatch.build([r.state for r in rows], [len(r.output) for r in rows], logits.shape[1])
    return sample_batch(logits, batch, pen, allowed)


def log_softmax(xs: list[float]) -> list[float]:
    """Hand reference: log-softmax with -inf entries excluded."""
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs if x != -math.inf))
    return [x - z if x != -math.inf else -math.inf for x in xs]


def draw_dist(logits: list[float], **kw) -> dict[int, float]:
    """{token id: logprob} of the distribution one draw uses, as the sampler reports it."""
    st = state(logprobs=MAX_LOGPROBS, **kw)
    out = sample(torch.tensor([logits]), [st])
    return dict(out.logprobs[0].top)


def assert_dist(got: dict[int, float], want: dict[int, float]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-5), k


# --- masks on fixed logits (docs/serving.md §10 extension fields) ---------------------------------

P4 = [0.5, 0.25, 0.15, 0.1]
LOG_P4 = [math.log(p) for p in P4]


def test_top_k_keeps_k_largest():
    logits = [3.0, 1.0, 2.0, 0.0, -1.0]
    want = log_softmax([3.0, -math.inf, 2.0, -math.inf, -math.inf])
    assert_dist(draw_dist(logits, top_k=2), {0: want[0], 2: want[2]})
    # top_k <= 0 disables it: every token stays
    assert len(draw_dist(logits, top_k=0)) == 5
    assert len(draw_dist(logits, top_k=-1)) == 5


def test_top_k_keeps_all_ties_at_the_boundary():
    logits = [2.0, 1.0, 1.0, 0.0]
    assert set(draw_dist(logits, top_k=2)) == {0, 1, 2}


@pytest.mark.parametrize("top_p, kept", [(0.7, [0, 1]), (0.8, [0, 1, 2]), (0.4, [0]), (1.0, [0, 1, 2, 3])])
def test_top_p_smallest_set_reaching_p(top_p, kept):
    # probabilities 0.5, 0.25, 0.15, 0.1: mass of strictly more likely tokens 0, .5, .75, .9
    s = sum(P4[i] for i in kept)
    assert_dist(draw_dist(LOG_P4, top_p=top_p), {i: math.log(P4[i] / s) for i in kept})


def test_top_k_ties_beyond_the_candidate_window_are_kept():
    # 60 tokens tie at the top_k=2 boundary, more than the 2·2 + 16 = 20-wide window holds: the
    # sampler redoes the step on whole rows. Kept: token 0 (logit 2) and all 60 ties (logit 1).
    logits = [2.0] + [1.0] * 60 + [0.0] * 39
    z = math.log(math.exp(2.0) + 60 * math.exp(1.0))
    row = state(top_k=2, top_p=0.99, logprobs=MAX_LOGPROBS, seed=4)
    lp = sample(torch.tensor([logits]), [row]).logprobs[0]
    assert lp.top[0] == (0, pytest.approx(2.0 - z))
    assert all(1 <= t <= 60 and v == pytest.approx(1.0 - z) for t, v in lp.top[1:]) and len(lp.top) == 20
    assert lp.logprob == pytest.approx((2.0 if lp.token_id == 0 else 1.0) - z)
    # top_p 0.99 keeps them too: token 0 has mass e^2 / e^z = .044 before the first tie


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # after top_k=3: .5/.9, .25/.9, .15/.9 = .556 .278 .167; token 2 has .833 before it >= .8 -> dropped
    # (on the raw distribution it would be kept: .75 < .8), so this shows top-k runs first.
    assert_dist(draw_dist(LOG_P4, top_k=3, top_p=0.8), {0: math.log(0.5 / 0.75), 1: math.log(0.25 / 0.75)})


@pytest.mark.parametrize("min_p, kept", [(0.25, [0, 1, 2]), (0.35, [0, 1]), (0.6, [0]), (0.0, [0, 1, 2, 3])])
def test_min_p_drops_below_min_p_times_p_max(min_p, kept):
    # thresholds .125 / .175 / .3 on probabilities .5 .25 .15 .1
    s = sum(P4[i] for i in kept)
    assert_dist(draw_dist(LOG_P4, min_p=min_p), {i: math.log(P4[i] / s) for i in kept})


def test_temperature_scales_logits():
    logits = [1.0, 0.5, -0.25]
    want = log_softmax([x / 0.5 for x in logits])
    assert_dist(draw_dist(logits, temperature=0.5), dict(enumerate(want)))


def test_logit_bias_added_before_everything():
    logits = [0.0, 0.0, 0.0, 0.0, 0.0]
    want = log_softmax([0.0, -100.0, 0.0, 2.0, 0.0])
    assert_dist(draw_dist(logits, logit_bias={3: 2.0, "1": -100}), dict(enumerate(want)))
    greedy = sample(torch.tensor([logits]), [state(temperature=0, logit_bias={3: 0.5})])
    assert greedy.token_ids == [3]


def test_repetition_penalty_on_prompt_and_output_tokens():
    # token 0 (prompt, positive) / 2 -> 1.0; token 1 (output, negative) * 2 -> -2.0; 2, 3 untouched
    logits = [2.0, -1.0, 1.0, 0.5]
    want = log_softmax([1.0, -2.0, 1.0, 0.5])
    assert_dist(draw_dist(logits, prompt=[0], output=[1, 1], repetition_penalty=2.0), dict(enumerate(want)))


def test_presence_penalty_on_output_tokens_only():
    logits = [2.0, -1.0, 1.0, 0.5]
    want = log_softmax([2.0, -1.5, 0.5, 0.5])  # outputs 1, 1, 2 -> -0.5 once each; prompt 0 untouched
    assert_dist(draw_dist(logits, prompt=[0], output=[1, 1, 2], presence_penalty=0.5), dict(enumerate(want)))


def test_frequency_penalty_scales_with_count():
    logits = [2.0, -1.0, 1.0, 0.5]
    want = log_softmax([2.0, -2.0, 0.5, 0.5])  # token 1 twice -> -1.0, token 2 once -> -0.5
    assert_dist(draw_dist(logits, prompt=[0], output=[1, 1, 2], frequency_penalty=0.5),
                dict(enumerate(want)))


def test_greedy_ignores_filters_and_returns_unscaled_logprobs():
    logits = [0.2, 1.5, 1.4]
    st = state(temperature=0.0, top_k=1, top_p=0.1, logprobs=3)
    out = sample(torch.tensor([logits]), [st])
    assert out.token_ids == [1]
    assert_dist(dict(out.logprobs[0].top), dict(enumerate(log_softmax(logits))))
    assert out.logprobs[0].rank == 1


def test_min_tokens_masks_eos_and_stop_ids_then_releases():
    eos, stop = 4, 3
    logits = torch.tensor([[0.0, 1.0, 0.5, 8.0, 9.0]])  # eos then stop id most likely
    toks = [sample(logits, [state(eos=(eos,), output=[1] * n, temperature=0, min_tokens=2,
                                  stop_token_ids=[stop])]).token_ids[0] for n in range(3)]
    assert toks == [1, 1, eos]  # 0 and 1 tokens so far: both masked; 2 tokens: released


def test_logprobs_rank_and_filtered_tokens_not_listed():
    logits = [3.0, 1.0, 2.0, 0.0]
    st = state(top_k=2, logprobs=4, seed=1)
    out = sample(torch.tensor([logits]), [st])
    lp = out.logprobs[0]
    assert len(lp.top) == 2  # only the two survivors, even though 4 were asked
    want = log_softmax([3.0, -math.inf, 2.0, -math.inf])
    assert lp.logprob == pytest.approx(want[lp.token_id], abs=1e-6)
    assert lp.rank == (1 if lp.token_id == 0 else 2)


def test_logprobs_zero_gives_chosen_token_only():
    out = sample(torch.tensor([[0.0, 1.0]] * 2), [state(temperature=0, logprobs=0), state(temperature=0)])
    assert out.logprobs[0].top == [] and out.logprobs[0].logprob == pytest.approx(log_softmax([0, 1])[1])
    assert out.logprobs[1] is None


def test_compute_logprobs_is_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    lp = compute_logprobs(logits, torch.tensor([0, 2]), [2, 0])
    ref0 = log_softmax([1.0, 2.0, 0.0])
    assert lp[0].logprob == pytest.approx(ref0[0]) and lp[0].rank == 2
    assert [t for t, _ in lp[0].top] == [1, 0]
    assert lp[1].logprob == pytest.approx(math.log(1 / 3)) and lp[1].top == []


# --- statistics ------------------------------------------------------------------------------

# Chi-square critical values at alpha = 0.001, from the chi-square quantile tables (df 7: 24.322,
# df 2: 13.816; df 2 is also exact by hand: -2 ln 0.001 = 13.8155).
CHI2_999 = {7: 24.322, 2: 13.816}


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0) + (
        math.inf if any(c and p == 0 for c, p in zip(counts, probs)) else 0.0)


def test_chi_square_20k_draws_temperature_1():
    probs = [0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]
    N = 20_000
    logits = torch.tensor([math.log(p) for p in probs]).repeat(N, 1)
    g = torch.Generator().manual_seed(1234)
    states = [state(generator=g) for _ in range(N)]   # unseeded: stream seeds drawn from g
    toks = torch.tensor(sample(logits, states).token_ids)
    assert chi_square(toks, probs) < CHI2_999[7]
    # the same statistic rejects a wrong hypothesis (power check): uniform over 8
    assert chi_square(toks, [1 / 8] * 8) > CHI2_999[7]


def test_chi_square_top_k_renormalised_seeded_rows():
    # 20k requests with their own seeds, top_k 3 on the same distribution: draws follow .3/.65 ...
    probs = [0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]
    N = 20_000
    logits = torch.tensor([math.log(p) for p in probs]).repeat(N, 1)
    toks = torch.tensor(sample(logits, [state(top_k=3, seed=i) for i in range(N)]).token_ids)
    assert int((toks >= 3).sum()) == 0
    assert chi_square(toks, [0.3 / 0.65, 0.2 / 0.65, 0.15 / 0.65]) < CHI2_999[2]


# --- seeded reproducibility across batch compositions ------------------------------------------

def _run(target_kw, others: list[dict], position: int, steps: int, seed_logits: int) -> list[int]:
    """Drive one target request through ``steps`` steps with the given neighbours; the target's
    logits row is the same in every run, the neighbours' rows are random."""
    g = torch.Generator().manual_seed(seed_logits)
    neigh_g = torch.Generator().manual_seed(999 + position + len(others))
    target = state(**target_kw)
    neigh = [state(**kw) for kw in others]
    toks = []
    for _ in range(steps):
        row = (torch.randn(1, 512, generator=g) * 3).bfloat16().float()  # bf16 -> many exact ties
        rows = torch.randn(len(others), 512, generator=neigh_g) * 3
        batch = torch.cat([rows[:position], row, rows[position:]])
        states = neigh[:position] + [target] + neigh[position:]
        out = sample(batch, states)
        toks.append(out.token_ids[position])
        for r, t in zip(states, out.token_ids):  # the next draw is at the next output position
            r.output.append(t)
    return toks


@pytest.mark.parametrize("target", [dict(seed=7), dict(seed=7, top_k=40, top_p=0.9),
                                    dict(seed=7, top_k=5, min_p=0.1, temperature=0.7, logprobs=2,
                                         repetition_penalty=1.3)])
def test_seeded_sampling_same_whatever_else_is_in_the_batch(target):
    alone = _run(target, [], 0, 24, seed_logits=3)
    crowd = [dict(temperature=0), dict(top_k=200, seed=1), dict(top_p=0.5), dict(top_k=0, top_p=1.0),
             dict(min_p=0.2, temperature=1.5, logprobs=5), dict(top_k=3, presence_penalty=1.0)]
    assert _run(target, crowd, 3, 24, seed_logits=3) == alone
    assert _run(target, crowd[:2], 0, 24, seed_logits=3) == alone
    assert _run(target, crowd[2:], 4, 24, seed_logits=3) == alone
    other_seed = dict(target, seed=8)
    assert _run(other_seed, [], 0, 24, seed_logits=3) != alone  # the seed matters


# --- the counter-based stream -----------------------------------------------------------------

def splitmix64_outputs(seed: int, n: int) -> list[int]:
    """Reference: SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c) in Python ints."""
    state, out, M = seed % 2 ** 64, [], 2 ** 64 - 1
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        out.append(z ^ (z >> 31))
    return out


def test_counter_uniforms_are_splitmix64_outputs():
    # position p of seed s = output p + 1 of SplitMix64 seeded with s, top 24 bits / 2**24
    seeds = [0, 1, 7, 2 ** 63 - 1, -(2 ** 63), -5, 2 ** 64 - 1, 123456789123456789]
    n = 6
    s_t = torch.tensor([s - 2 ** 64 if s >= 2 ** 63 else s for s in seeds for _ in range(n)])  # int64
    p_t = torch.arange(n).repeat(len(seeds))
    got = counter_uniforms(s_t, p_t).tolist()
    want = [(z >> 40) / 2 ** 24 for s in seeds for z in splitmix64_outputs(s, n)]
    assert got == want


def test_seeded_draw_depends_on_seed_and_position_only():
    # the same (seed, output position) gives the same token in any batch, at any row; the next
    # position is a fresh uniform (hand check: u = splitmix output / 2**24 against the CDF .5/.75/1)
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]])
    for seed in (3, 11, 2 ** 64 - 2):
        for n_out in (0, 5):
            u = (splitmix64_outputs(seed, n_out + 1)[-1] >> 40) / 2 ** 24
            want = 0 if u < 0.5 else (1 if u < 0.75 else 2)
            alone = sample(logits, [state(seed=seed, output=[0] * n_out)]).token_ids
            crowd = sample(logits.repeat(3, 1), [state(seed=1), state(seed=seed, output=[0] * n_out),
                                                  state(temperature=0)]).token_ids
            assert alone == [want] and crowd[1] == want


# --- constrained decoding: the allowed-token bitmask -------------------------------------------

def test_allowed_bitmask_after_penalties_and_before_temperature():
    # V = 40, two words; allow 0, 31 (sign bit of word 0) and 33: bits 0 and 31 of word 0, bit 1 of
    # word 1. Presence penalty on output token 33 first, then the mask, then temperature 0.5.
    V = 40
    logits = [0.1 * i for i in range(V)]
    allowed = torch.tensor([[1 | (1 << 31) - 2 ** 32, 1 << 1]], dtype=torch.int32)
    row = state(output=[33], presence_penalty=1.0, temperature=0.5, logprobs=MAX_LOGPROBS)
    got = dict(sample(torch.tensor([logits]), [row], allowed).logprobs[0].top)
    x = [logits[0] / 0.5, logits[31] / 0.5, (logits[33] - 1.0) / 0.5]
    assert_dist(got, dict(zip([0, 31, 33], log_softmax(x))))
    greedy = sample(torch.tensor([logits]), [state(temperature=0)], allowed)
    assert greedy.token_ids == [33]  # the best allowed one, not 39
    all_bits = torch.full((1, 2), -1, dtype=torch.int32)
    assert sample(torch.tensor([logits]), [state(temperature=0)], all_bits).token_ids == [39]
    with pytest.raises(ValueError, match=r"int32 \[1, 2\]"):
        sample(torch.tensor([logits]), [state()], torch.zeros(1, 1, dtype=torch.int32))


def test_apply_allowed_bitmask_matches_a_bit_by_bit_reference():
    """Random words (sign bits included), V not a multiple of 32, and +inf / -inf / NaN logits: a
    token keeps its logit iff bit t % 32 of word t // 32 is set (read with Python ints), else it is
    -inf, whatever its logit (NaN and +inf included); an allowed NaN reads +inf."""
    gen = torch.Generator().manual_seed(0)
    B, V = 5, 77
    allowed = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, 3), dtype=torch.int32, generator=gen)
    allowed[0] = -1
    x = torch.randn(B, V, generator=gen)
    x[:, :4] = torch.tensor([math.inf, -math.inf, math.nan, 5.0])
    got = apply_allowed_bitmask(x, allowed)
    assert not (allowed[1:, 0] & 0b1111 == 0b1111).all()  # some of the special logits are forbidden
    for b in range(B):
        words = [w % 2 ** 32 for w in allowed[b].tolist()]
        for t in range(V):
            keep = (words[t // 32] >> (t % 32)) & 1
            value = x[b, t].item()
            want = (math.inf if math.isnan(value) else value) if keep else -math.inf
            assert got[b, t].item() == want, (b, t)


# --- pure, and one host sync ----------------------------------------------------------------------

class HostReads(TorchFunctionMode):
    """Records Python-level host reads of tensors (tolist, item, bool(), ...)."""

    NAMES = {"tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


class OpNames(TorchDispatchMode):
    """Records the name of every dispatched aten op."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kws", [
    # whole rows (a sampled row without top-k), penalties, bias, min_tokens, logprobs
    [dict(seed=1, top_k=20, top_p=0.8, min_p=0.05, logprobs=3, repetition_penalty=1.2, prompt=[5]),
     dict(temperature=0, logit_bias={7: 3.0}, min_tokens=2, eos=(9,)),
     dict(seed=2, presence_penalty=0.5, output=[1, 1]), dict(top_k=0)],
    # every sampled row with top-k: the candidate windows
    [dict(seed=1, top_k=20, top_p=0.8), dict(top_k=3, logprobs=2), dict(top_k=40, min_p=0.1),
     dict(temperature=0)],
    [dict(seed=1, top_k=20), dict(top_k=3)],
])
def test_sample_is_pure_and_syncs_once(kws):
    logits = torch.randn(len(kws), 300, generator=torch.Generator().manual_seed(0))
    rows = [state(**kw) for kw in kws]
    pen = PenaltyState(300)
    for r in rows:
        r.state.penalty_row = pen.add(r.prompt, r.output) if r.state.needs_penalties else 0
    counts = pen.counts.clone()
    before = [(r.state.seed, r.state.in_reasoning, list(r.output)) for r in rows]
    batch = SamplingBatch.build([r.state for r in rows], [len(r.output) for r in rows], 300)
    reads, names = HostReads(), OpNames()
    with reads, names:
        first = sample_batch(logits, batch, pen)
    assert first == sample_batch(logits, batch, pen)
    assert [(r.state.seed, r.state.in_reasoning, list(r.output)) for r in rows] == before
    assert torch.equal(pen.counts, counts)
    assert reads.calls == ["tolist"]              # the packed ids (+ logprobs): one device->host copy
    assert not {"nonzero", "_local_scalar_dense", "masked_select", "unique_dim", "_unique2"} & names.ops


# --- thinking_temperature switch (docs/serving.md §10; state from docs/parsers.md P1) ----------

THINK_END, TOOL_START = 11, 12


def thinking_state(**kw) -> SamplingState:
    kw = dict(temperature=0.5, thinking_temperature=2.0, start_in_reasoning=True,
              reasoning_end_token_ids=[THINK_END, TOOL_START]) | kw
    return state(**kw).state


def test_thinking_temperature_until_an_end_token_id():
    st = thinking_state()
    assert st.in_reasoning and st.temperature == 2.0
    for t in (1, 2, 200):  # ordinary ids keep reasoning
        st.observe(t)
    assert st.temperature == 2.0
    st.observe(THINK_END)
    assert not st.in_reasoning and st.temperature == 0.5
    st.observe(1)
    assert st.temperature == 0.5  # never switches back
    assert st.num_reasoning_tokens == 4  # 1, 2, 200 and the end id itself


def test_tool_call_start_also_ends_reasoning():
    st = thinking_state()
    st.observe(TOOL_START)
    assert st.temperature == 0.5


def test_no_thinking_temperature_without_start_in_reasoning_or_field():
    assert thinking_state(start_in_reasoning=False).temperature == 0.5
    assert thinking_state(thinking_temperature=None).temperature == 0.5


def test_sampler_uses_thinking_temperature_then_temperature():
    # greedy while thinking (thinking_temperature 0) picks the end id; after it, the draw is at
    # T=0.5, visible in the returned logprobs (distribution of logits / 0.5)
    logits = [0.0] * 16
    logits[THINK_END] = 1.0
    row = state(temperature=0.5, thinking_temperature=0.0, start_in_reasoning=True,
                reasoning_end_token_ids=[THINK_END, TOOL_START], logprobs=MAX_LOGPROBS, seed=3)
    first = sample(torch.tensor([logits]), [row])
    assert first.token_ids == [THINK_END] and row.state.in_reasoning  # sample() changes nothing
    row.state.observe(THINK_END)
    second = sample(torch.tensor([logits]), [row])
    want = log_softmax([x / 0.5 for x in logits])
    assert_dist(dict(second.logprobs[0].top), dict(enumerate(want)))


# --- params: defaults and validation -------------------------------------------------------

def test_none_takes_generation_config_defaults():
    r = SamplingParams().resolved(MINIMAX)
    assert (r.temperature, r.top_p, r.top_k) == (1.0, 0.95, 40)
    r = SamplingParams(temperature=0.3, top_k=-1).resolved(MINIMAX)
    assert (r.temperature, r.top_p, r.top_k) == (0.3, 0.95, 0)
    r = SamplingParams().resolved(NO_DEFAULTS)
    assert (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, 0)


def test_unresolved_params_refused_by_state():
    with pytest.raises(ValueError, match="resolved"):
        SamplingState.new(SamplingParams(), [1])


def test_child_params_for_n():
    p = SamplingParams(n=3, seed=5)
    assert [(c.n, c.seed) for c in (p.child(0), p.child(2))] == [(1, 5), (1, 7)]
    assert SamplingParams(n=2).child(1).seed is None


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.1), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(n=0), "n"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(thinking_temperature=-1), "thinking_temperature"),
    (dict(reasoning_end_token_ids=["a"]), "reasoning_end_token_ids"),
    (dict(repetition_penalty=100.5), "repetition_penalty"), (dict(logit_bias={" 5": 1}), "logit_bias"),
    (dict(logit_bias={"1_0": 1}), "logit_bias"), (dict(logit_bias={"+5": 1}), "logit_bias"),
    (dict(logit_bias={"\u0665": 1}), "logit_bias"), (dict(stop=["a\ud800"]), "stop"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_token_ids_checked_against_vocab():
    SamplingParams(logit_bias={9: 1}).check_token_ids(10)
    SamplingParams(logit_bias={"9": 1}, top_k=10, repetition_penalty=100).check_token_ids(10)
    with pytest.raises(ValueError, match=r"top_k=11: must be at most the vocabulary size 10"):
        SamplingParams(top_k=11).check_token_ids(10)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 10 .*\[0, 10\)"):
        SamplingParams(stop_token_ids=[10]).check_token_ids(10)


def test_stop_string_normalised_to_tuple():
    assert SamplingParams(stop="###").stop == ("###",)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match="one row per request"):
        sample(torch.zeros(2, 4), [state()])


def test_top_k_candidates_and_whole_row_paths_agree():
    # alone, the batch's widest top-k is the row's own; next to a row without top-k (and, with
    # top_p, through the sorted path) the cuts are the same values: same kept set and logprobs,
    # ties included (bf16 logits).
    g = torch.Generator().manual_seed(5)
    for kw in (dict(top_k=7), dict(top_k=20, top_p=0.6), dict(top_k=12, min_p=0.3, temperature=0.8)):
        row = (torch.randn(1, 300, generator=g) * 2).bfloat16().float()
        alone = sample(row, [state(logprobs=MAX_LOGPROBS, seed=1, **kw)]).logprobs[0]
        pair = sample(torch.cat([row, row]), [state(logprobs=MAX_LOGPROBS, seed=1, **kw), state(top_k=0)])
        both = pair.logprobs[0]
        assert alone.token_id == both.token_id
        assert dict(alone.top) == pytest.approx(dict(both.top), abs=1e-5)


# --- property test against a plain-Python reference of docs/serving.md §10 -----------------------------

def reference_distribution(logits, prompt, output, eos, p: SamplingParams) -> dict[int, float]:
    """{token: logprob} of the distribution one draw uses, in plain Python, step by step in the
    spec's order (bias and min_tokens mask first, then penalties, temperature, top-k, top-p, min-p)."""
    x = list(logits)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = -math.inf
    seen = set(prompt) | set(output)
    for t in range(len(x)):
        if t in seen and x[t] != -math.inf:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = output.count(t)
        x[t] -= p.presence_penalty * (c > 0) + p.frequency_penalty * c
    if p.temperature == 0:
        return {t: v for t, v in enumerate(log_softmax(x)) if v != -math.inf}
    x = [v / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    probs = [math.exp(v) for v in log_softmax(x)]
    if p.top_p < 1:
        x = [v if sum(q for q in probs if q > probs[t]) < p.top_p else -math.inf for t, v in enumerate(x)]
    if p.min_p > 0:
        m = max(x)
        x = [v if v >= m + math.log(p.min_p) else -math.inf for v in x]
    return {t: v for t, v in enumerate(log_softmax(x)) if v != -math.inf}


V_SMALL = 10


@settings(max_examples=150, derandomize=True, deadline=None)
@given(logits=st.lists(st.integers(-12, 12).map(lambda i: i / 4), min_size=V_SMALL, max_size=V_SMALL),
       prompt=st.lists(st.integers(0, V_SMALL - 1), max_size=4),
       output=st.lists(st.integers(0, V_SMALL - 1), max_size=4),
       temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]), top_k=st.integers(0, V_SMALL),
       top_p=st.sampled_from([1.0, 0.93, 0.61, 0.27]), min_p=st.sampled_from([0.0, 0.05, 0.33]),
       rep=st.sampled_from([1.0, 1.3]), pres=st.sampled_from([0.0, 0.4]), freq=st.sampled_from([0.0, -0.3]),
       bias=st.dictionaries(st.integers(0, V_SMALL - 1), st.sampled_from([-3.0, 2.5]), max_size=2),
       min_tokens=st.integers(0, 3), in_batch=st.booleans())
def test_sampler_matches_plain_python_reference(logits, prompt, output, temperature, top_k, top_p, min_p, rep,
                                                pres, freq, bias, min_tokens, in_batch):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
              presence_penalty=pres, frequency_penalty=freq, logit_bias=bias, min_tokens=min_tokens)
    st_ = state(prompt=prompt, eos=(V_SMALL - 1,), output=output, logprobs=MAX_LOGPROBS, seed=0, **kw)
    want = reference_distribution(logits, prompt, output, (V_SMALL - 1,), st_.state.params)
    rows = torch.tensor([logits, logits[::-1]] if in_batch else [logits])  # neighbour without top-k
    states = [st_, state()] if in_batch else [st_]
    out = sample(rows, states)
    assert_dist(dict(out.logprobs[0].top), want)
    assert out.token_ids[0] in want


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("temperature", [1.0, 1e-5])  # 1e-5: the smallest sampled (non-greedy) one
@pytest.mark.parametrize("rep", [1e-38, 1e-34])
def test_extreme_penalty_or_temperature_cannot_overflow_the_draw(rep, temperature, top_k):
    # adversarial (a 503 that killed the engine): a positive logit / a tiny repetition_penalty, or / a tiny
    # temperature, overflowed to +inf; softmax then made NaN and the draw an out-of-range id. The seen
    # token's logit becomes the largest finite float: it must be drawn, whatever the uniform
    logits = [1.0, 2.0, 4.0, 5.0, -1.0]  # 4 / 1e-38 and 4 / 1e-34 / 1e-5 exceed the float32 range
    for seed in range(5):
        st = state(prompt=[2], repetition_penalty=rep, temperature=temperature, top_k=top_k, logprobs=2)
        st.state.seed = seed
        out = sample(torch.tensor([logits]), [st])
        assert out.token_ids == [2]
        assert out.logprobs[0].logprob == 0.0 and math.isfinite(out.logprobs[0].top[0][1])
