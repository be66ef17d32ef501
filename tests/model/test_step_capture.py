"""A step a GPU can capture (issue 29): the step's metadata in persistent buffers, the attention
backend chosen once, and an op count that does not follow the batch (docs/serving.md §6.1,
docs/kernels.md §7).

The op counts are observed with a TorchDispatchMode (tests/model/test_step_sync.py's ``SyncAudit``),
independently of the code under test; kernel launches are counted at the kernel object. References:
the torch backend (itself checked against transformers in test_parity.py), the engine without the
persistent buffers, and the materialised-mask path for ``causal_lower_right``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import m2serve.kernels.triton  # noqa: F401  (before anything imports triton: docs/kernels.md §1)
from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.runner import bucket_for, decode_buckets
from m2serve.engine.sampling import SamplingParams
from m2serve.model.attention import attend, resolve_attention_backend
from m2serve.model.batch import StepBuffers, ragged_batch
from m2serve.model.load import load_model
from m2serve.model.step import RopeCache, StepContext


class OpCount(TorchDispatchMode):
    """Records the name of every dispatched aten op."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

PROMPTS = [[5 + (i * 7) % 50, 9 + i % 11, 3 + (i * 5) % 13] for i in range(32)]


def _engine(model, batch_size: int) -> LLMEngine:
    args = EngineArgs(dtype="float32", kv_cache_format="float32", num_kv_pages=160, kv_cache_page_size=4,
                      max_batch_input_tokens=128, max_batch_size=batch_size, seed=0)
    return LLMEngine.from_model(model, model.config, args)


def _decode_step_ops(model, batch_size: int) -> tuple[int, list[int]]:
    """(aten ops of one engine decode step at ``batch_size``, paged-attention kernel launches per
    model forward of that step). The prompts are prefilled first; the measured step decodes them all."""
    engine = _engine(model, batch_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(str(i), PROMPTS[i], greedy)
    first = engine.step()  # every prompt prefilled in one step (3 x 32 tokens <= 128)
    assert sorted(len(o.new_token_ids) for o in first) == [1] * batch_size
    launches: list[int] = []
    kernel_module = None
    if model.attention_kernel is not None:
        import importlib

        kernel_module = importlib.import_module("m2serve.kernels.triton.attention")
    audit = OpCount()
    with audit:
        if kernel_module is None:
            engine.step()
        else:
            real = kernel_module._paged_attention_kernel, kernel_module._combine_splits_kernel
            counted = [0]

            class Counted:
                def __init__(self, k):
                    self.k = k

                def __getitem__(self, grid):
                    counted[0] += 1
                    return self.k[grid]
            kernel_module._paged_attention_kernel = Counted(real[0])
            kernel_module._combine_splits_kernel = Counted(real[1])
            try:
                engine.step()
            finally:
                kernel_module._paged_attention_kernel, kernel_module._combine_splits_kernel = real
            launches.append(counted[0])
    return len(audit.ops), launches


@pytest.mark.slow
def test_triton_backend_decode_ops_do_not_grow_with_the_batch(tiny_random_dir):
    # issue 29 must-show: under the interpreter, batch 32 <= 1.25 x batch 1 (torch backend: the
    # per-request attention loop makes it grow), and one attention kernel launch per layer
    triton_model = load_model(tiny_random_dir, attention_backend="triton")
    assert triton_model.attention_backend == "triton"
    n1, l1 = _decode_step_ops(triton_model, 1)
    n32, l32 = _decode_step_ops(triton_model, 32)
    layers = triton_model.config.num_hidden_layers
    assert l1 == l32 == [layers]
    assert n32 <= 1.25 * n1, (n1, n32)
    torch_model = load_model(tiny_random_dir, attention_backend="torch")
    t1, _ = _decode_step_ops(torch_model, 1)
    t32, _ = _decode_step_ops(torch_model, 32)
    assert t32 > 2 * t1, (t1, t32)  # the audit can fail: the reference loops over the requests


def _greedy_tokens(model, buffers: bool) -> dict[str, list[int]]:
    engine = _engine(model, 8)
    if not buffers:
        engine.runner.buffers = engine.runner.sampling_buffers = None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(5):
        engine.add_request(str(i), PROMPTS[i] * (i + 1), params)
    # and the sampler's inputs: seeded draws with top-k / top-p / min-p, penalties, logit bias, min_tokens
    engine.add_request("seeded", [4, 5, 6], SamplingParams(
        temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=7, max_tokens=6, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=0.2, logit_bias={11: 2.5}, min_tokens=6))
    out: dict[str, list[int]] = {}
    for o in engine.step():
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("late", list(range(3, 40)), params)  # a chunked prefill next to decodes
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    if buffers:
        assert engine.runner.buffers.loads >= 6 and engine.runner.sampling_buffers.loads >= 6
    return out


def test_greedy_tokens_identical_with_and_without_persistent_buffers(tiny_random_dir):
    model = load_model(tiny_random_dir, attention_backend="torch")
    with_buffers, without = _greedy_tokens(model, True), _greedy_tokens(model, False)
    assert len(with_buffers) == 7 and all(len(t) == 6 for t in with_buffers.values())
    assert with_buffers == without


@pytest.mark.slow
def test_triton_backend_greedy_tokens_equal_torch_backend(tiny_random_dir):
    # the kernel against the reference on the whole engine path (prefill chunks after a cached
    # prefix, decodes, several requests), fp32 under the interpreter
    torch_tokens = _greedy_tokens(load_model(tiny_random_dir, attention_backend="torch"), True)
    triton_tokens = _greedy_tokens(load_model(tiny_random_dir, attention_backend="triton"), True)
    assert torch_tokens == triton_tokens


def test_persistent_buffers_one_copy_and_views():
    # every field is a view of the one device buffer; values equal the per-field copies
    buffers = StepBuffers(torch.device("cpu"))
    args = ([[1, 2, 3], [4]], [5, 9], [[2, 3], [7, 8, 1]], [1, 1], 4)
    ref = ragged_batch(*args, data_parallel_splits=[0, 1, 2])
    batch = ragged_batch(*args, data_parallel_splits=[0, 1, 2], buffers=buffers)
    base = buffers.dev.untyped_storage().data_ptr()
    for name in ("tokens", "positions", "slot_mapping", "return_n_logits", "data_parallel_splits",
                 "logit_rows"):
        assert getattr(batch, name).untyped_storage().data_ptr() == base, name
    for name in ("tokens", "positions", "input_row_offsets", "slot_mapping", "block_tables", "context_lens",
                 "return_n_logits", "data_parallel_splits"):
        a, b = getattr(batch, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert batch.logit_rows.tolist() == ref.host.logit_rows == [2, 3]
    with pytest.raises(ValueError, match="request 1: context_lens=9 needs 3 pages"):
        ragged_batch([[1], [2]], [1, 9], [[0], [1, 2]], [1, 1], 4, buffers=buffers)


def test_causal_lower_right_equals_the_materialised_mask():
    # the torch backend on CUDA: a chunk after a cached prefix takes causal_lower_right, not an
    # [n, L] mask; on CPU both run, and agree with the mask the CPU path builds
    torch.manual_seed(0)
    S, Hkv, Hq, D = 4, 2, 4, 16
    from m2serve.model.batch import KVStorage

    kv = KVStorage.allocate(1, 12, S, Hkv, D, torch.float32)
    kv.k[0].normal_()
    kv.v[0].normal_()
    batch = ragged_batch([[1] * 5, [2], [3] * 3], [9, 6, 3], [[0, 1, 2], [3, 4], [5]], [5, 1, 3], S)
    q = torch.randn(9, Hq, D)
    masked = StepContext.build(batch, S, RopeCache(8, 1e4), torch.float32)
    lower = StepContext.build(batch, S, RopeCache(8, 1e4), torch.float32, lower_right=True)
    assert masked.masks[0] is not None and isinstance(masked.masks[0], torch.Tensor)
    assert type(lower.masks[0]).__name__ == "CausalBias"
    torch.testing.assert_close(attend(q, kv, 0, lower, 0.25), attend(q, kv, 0, masked, 0.25),
                               rtol=1e-6, atol=1e-6)


def test_attention_backend_choice():
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="attention_backend='flash'.*'auto', 'torch', 'triton'"):
        resolve_attention_backend("flash", "cpu")


def test_decode_buckets():
    assert decode_buckets(256)[:7] == [1, 2, 4, 8, 16, 32, 48] and decode_buckets(256)[-1] == 256
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40] and decode_buckets(1) == [1]
    assert bucket_for(3, decode_buckets(40)) == 4 and bucket_for(33, decode_buckets(40)) == 40
    assert bucket_for(17, [1, 2, 4, 8, 16, 32]) == 32 and bucket_for(41, decode_buckets(40)) is None


def test_padded_and_unpadded_decode_give_identical_tokens(tiny_random_dir):
    # issue 29 item 3, eagerly on CPU: all-decode steps padded to their bucket (3 -> 4, 5 -> 8
    # requests; the padding rows write a page of their own) give the unpadded engine's tokens.
    # torch backend (the triton one is the same engine path, checked against torch above; under
    # the interpreter it would add ~25 s)
    model = load_model(tiny_random_dir, attention_backend="torch")
    sizes: list[int] = []
    real = model.forward

    def forward(batch, kv):
        sizes.append(batch.num_requests)
        return real(batch, kv)
    model.forward = forward
    runs = []
    for pad in (False, True):
        engine = _engine(model, 8)
        if pad:
            engine.runner.enable_decode_padding(8)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        out: dict[str, list[int]] = {}
        for i in range(5):
            engine.add_request(str(i), PROMPTS[i] * (1 + i % 2), SamplingParams(
                temperature=0.0, max_tokens=3 + i, ignore_eos=True) if i < 3 else params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs.append(out)
        if pad:
            assert {4, 8} <= set(sizes) and not set(sizes) - {5, 4, 8}, sizes
        sizes.clear()
    assert runs[0] == runs[1] and sorted(len(t) for t in runs[0].values()) == [3, 4, 5, 5, 5]


def test_sampling_batch_from_buffers_equals_per_field_copies():
    from m2serve.engine.sampling import SamplingBatch, SamplingState

    states = [SamplingState.new(SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, min_tokens=m,
                                               logit_bias=b, repetition_penalty=1.1, presence_penalty=0.2),
                                [2], torch.Generator().manual_seed(0))
              for t, k, p, s, m, b in ((0.0, 0, 1.0, None, 0, None), (0.7, 5, 0.8, 3, 4, {7: -1.5, 9: 0.25}),
                                       (1.3, 0, 0.95, 2 ** 63 + 5, 0, {1: 3.0}))]
    buffers = StepBuffers(torch.device("cpu"))
    a = SamplingBatch.build(states, [0, 1, 2], 64, "cpu", (), buffers)
    b = SamplingBatch.build(states, [0, 1, 2], 64, "cpu")
    assert buffers.loads == 1
    for name in SamplingBatch.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif isinstance(x, tuple):
            assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(x, y, strict=True)), name
        else:
            assert x == y, name


def test_batch_invariant_mode_refuses_the_triton_backend(tiny_random_dir):
    with pytest.raises(ValueError, match="batch_invariant: needs attention_backend='torch'"):
        load_model(tiny_random_dir, attention_backend="triton", batch_invariant=True)
