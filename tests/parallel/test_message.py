"""The per-step message to the other ranks carries what changed (issue 27 item 5, parallel/message.py).

- Its size does not grow with context: the same 4-request decode batch at contexts of 100 and
  10,000 tokens (block tables built directly, as already sent) gives messages of equal size, when no
  page is appended; the first message of a request (its whole table) does grow.
- The other ranks rebuild exactly rank 0's batch (every tensor and host list) over new requests,
  chunked prefill, decodes with page appends, a finished request whose id is reused, and a
  preempted request re-allocated from position 0.
"""

from __future__ import annotations

import pytest
import torch

from m2serve.model.batch import ForwardBatch, ragged_batch
from m2serve.parallel.message import MessageDecoder, MessageEncoder

S = 16


def _decode_step(context: int, encoder: MessageEncoder) -> int:
    """Message bytes of one decode step of 4 requests reaching ``context`` tokens, their tables
    (ceil(context / S) pages each) already on the other ranks."""
    pages = -(-context // S)
    tables = [list(range(b * pages, (b + 1) * pages)) for b in range(4)]
    ids = [f"req-{b}" for b in range(4)]
    for rid, t in zip(ids, tables):
        encoder.sent[rid] = list(t)
    batch = ragged_batch([[7 + b] for b in range(4)], [context] * 4, tables, [1] * 4, S, request_ids=ids)
    return encoder.encode(batch).nbytes


def test_message_size_does_not_grow_with_context():
    assert (-(-99 // S), -(-9999 // S)) == (-(-100 // S), -(-10000 // S))  # no page appended at 100 / 10,000
    short, long = _decode_step(100, MessageEncoder()), _decode_step(10_000, MessageEncoder())
    assert short == long
    # the first step of a request sends its whole table: that one grows (625 vs 7 pages of int64)
    first = [MessageEncoder().encode(ragged_batch([[1]], [c], [list(range(-(-c // S)))], [1], S,
                                                  request_ids=["x"])).nbytes for c in (100, 10_000)]
    assert 8 * (625 - 7) <= first[1] - first[0] <= 8 * (625 - 7) + 8   # + the length field of pickle bytes


def _same(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("tokens", "positions", "input_row_offsets", "slot_mapping", "block_tables", "context_lens",
                 "return_n_logits"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("query_starts", "context_lens", "block_tables", "logit_rows", "logit_counts",
                 "data_parallel_splits", "request_ids", "tokens", "finished_request_ids"):
        assert getattr(a.host, name) == getattr(b.host, name), name


def test_other_ranks_rebuild_rank0_batch_step_by_step():
    enc, dec = MessageEncoder(), MessageDecoder()
    steps = [  # (ids, new tokens, contexts, tables, logits rows, splits, finished)
        (["a", "b"], [[1, 2, 3, 4, 5], list(range(20))], [5, 20], [[3], [0, 1]], [1, 0], [0, 1, 2], []),
        (["a", "b"], [[6], list(range(20, 30))], [6, 30], [[3], [0, 1]], [1, 1], [0, 1, 2], []),
        (["a", "b"], [[7] * 11, [31]], [17, 31], [[3, 9], [0, 1]], [1, 1], [0, 1, 2], []),   # a appends
        (["b", "a"], [[32], [8]], [32, 18], [[0, 1], [3, 9]], [1, 1], [0, 2, 2], []),        # one replica
        (["a", "b"], [[1, 2], [33]], [2, 33], [[5], [0, 1, 4]], [1, 1], [0, 1, 2], ["a"]),  # id reused
        (["b"], list([[1] * 16]), [16], [[6]], [1], [0, 0, 1], []),                          # preempted b
    ]
    for ids, new, ctx, tables, nl, splits, finished in steps:
        batch = ragged_batch(new, ctx, tables, nl, S, data_parallel_splits=splits, request_ids=ids)
        batch.host.finished_request_ids = finished
        msg = enc.encode(batch)
        _same(dec.decode(msg, S), batch)



def test_static_decode_steps_keep_the_tables_in_step():
    # TP_TP static decode (docs/serving.md §6.3): a decode step travels as the same message with
    # the bucket set; the other ranks apply its page deltas (append, finished id reused, preemption
    # reset) and get rank 0's rows, so an eager step after it rebuilds rank 0's batch exactly
    enc, dec = MessageEncoder(), MessageDecoder()
    first = ragged_batch([[1, 2, 3, 4], [5] * 16], [4, 16], [[3], [0]], [1, 1], S, request_ids=["a", "b"])
    dec.decode(enc.encode(first), S)
    statics = [  # (ids, tokens, contexts, tables, finished, bucket): rows the other ranks must see
        (["a", "b"], [6, 7], [5, 17], [[3], [0, 1]], [], 2),           # b appends page 1
        (["b", "a", "c"], [8, 9, 1], [18, 6, 1], [[0, 1], [3], [8]], [], 4),  # c new (its whole table)
        (["a", "c"], [2, 3], [1, 2], [[5], [8]], ["a", "b"], 2),       # a reused after finishing, b gone
        (["c"], [4], [17], [[9, 2]], [], 1),                           # c preempted: table replaced
    ]
    for ids, tokens, ctx, tables, finished, bucket in statics:
        msg = enc.encode_decode(ids, tokens, ctx, tables, finished, bucket)
        assert msg.bucket == bucket and msg.request_ids == ids
        assert dec.apply(msg) == ([[t] for t in tokens], ctx, [1] * len(ids), tables)
    assert set(dec.tables) == {"a", "c"}
    after = ragged_batch([[5], [6, 7]], [18, 3], [[9, 2, 4], [5]], [1, 1], S, request_ids=["c", "a"])
    after.host.finished_request_ids = []
    msg = enc.encode(after)
    assert msg.bucket is None and len(msg.pages) == 8   # only c's appended page 4 travels
    _same(dec.decode(msg, S), after)
    with pytest.raises(ValueError, match="2 request_ids, 1 tokens, 2 context_lens, 2 block_tables for"):
        enc.encode_decode(["a", "c"], [1], [2, 3], [[5], [8]], [], 2)
    with pytest.raises(ValueError, match="for bucket 1: give one of each per row, at most bucket rows"):
        enc.encode_decode(["a", "c"], [1, 2], [2, 3], [[5], [8]], [], 1)

def test_sampling_fields_travel_once():
    # issue 27 item 5 for the replicas' draws (engine/sampling.py SamplingRows): a request's
    # sampling state goes to its replica once; later steps carry only per-row fixed fields, and a
    # row drawn from the held state equals the sampler run on the request's own state
    import pickle

    from m2serve.engine.sampling import SamplingBatch, SamplingParams, SamplingRows, SamplingState, sample

    V = 64
    params = [SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.0, seed=s, max_tokens=8)
              for s in (1, 2, 3)]
    states = [SamplingState.new(p) for p in params]
    ids = ["x", "y", "z"]
    held_ids: set[str] = set()
    first = SamplingRows.of(ids, states, [0, 0, 0], [False] * 3, None, V, held_ids)
    later = [SamplingRows.of(ids, states, [n] * 3, [False] * 3, None, V, held_ids) for n in (1, 1000)]
    assert set(first.new_states) == set(ids) and all(not r.new_states for r in later)
    sizes = [len(pickle.dumps(r)) for r in (first, *later)]
    # no state after the first step: only pickle's int width grows with the output position
    assert abs(sizes[2] - sizes[1]) <= 3 and sizes[2] < sizes[0] - 3 * 40
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    replica: dict = {}   # the drawing rank's held states, filled from the first message (pickled)
    for r in (first, *later):
        got = pickle.loads(pickle.dumps(r)).sample(logits, held=replica)
        want = sample(logits, SamplingBatch.build(states, r.num_output_tokens, V))
        assert got.token_ids == want.token_ids
