"""Framing of stage messages, token returns and prompt KV chunks (no pickle, strict decoding)."""

from __future__ import annotations

import pytest
import torch

from dejavu_worker.dataplane import Kind, KVChunk, Returned, StageMessage, TokenReturn, frame, unframe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_stage_message_round_trip(dtype) -> None:
    x = (torch.randn(2, 3, 5) * 100).to(dtype)
    msg = StageMessage(Kind.DECODE, mb_id=3, step=17, tensor=x, meta={"task": {"a": 1}})
    back = StageMessage.decode(msg.encode())
    assert (back.kind, back.mb_id, back.step, back.meta) == (Kind.DECODE, 3, 17, {"task": {"a": 1}})
    assert back.tensor.dtype == dtype and torch.equal(back.tensor, x)


def test_token_return_and_kv_chunk_round_trip() -> None:
    ret = TokenReturn(cohort=1, members=(Returned(3, 4, (5, 0, 7), False, (0, 2)), Returned(9, 1, (2,), True)))
    assert TokenReturn.decode(ret.encode()) == ret
    x = torch.randn(3, 1, 8)
    cohort = StageMessage(Kind.DECODE, mb_id=0, step=0, tensor=x, members=((3, 4, (0, 2)), (9, 1, (0,))))
    assert StageMessage.decode(cohort.encode()).members == ((3, 4, (0, 2)), (9, 1, (0,)))
    k, v = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 3, 4, 8)
    c = KVChunk(mb_id=2, layers=(5, 6), rows=(2, 4), positions=(3, 7), k=k, v=v)
    back = KVChunk.decode(c.encode())
    assert (back.layers, back.rows, back.positions) == ((5, 6), (2, 4), (3, 7))
    assert torch.equal(back.k, k) and torch.equal(back.v, v)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00[]", frame({"dtype": "float32", "shape": [4]}, None) + b"\x00" * 3],
)
def test_malformed_payloads_raise_value_error(payload) -> None:
    with pytest.raises(ValueError):
        unframe(payload)


def test_a_pass_of_kv_chunks_travels_as_one_message() -> None:
    from dejavu_worker.dataplane import decode_chunks, encode_chunks

    chunks = [
        KVChunk(3, (4, 6), (0, 2), (9, 10), torch.randn(2, 2, 3, 1, 8), torch.randn(2, 2, 3, 1, 8), step=5),
        KVChunk(7, (4, 6), (0, 1), (0, 4), torch.randn(2, 1, 3, 4, 8), torch.randn(2, 1, 3, 4, 8), step=0),
    ]
    back = decode_chunks(encode_chunks(chunks))
    assert [(c.mb_id, c.layers, c.rows, c.positions, c.step) for c in back] == [
        (3, (4, 6), (0, 2), (9, 10), 5),
        (7, (4, 6), (0, 1), (0, 4), 0),
    ]
    for a, b in zip(chunks, back, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    (single,) = decode_chunks(chunks[0].encode())  # a lone chunk still decodes
    assert single.mb_id == 3 and torch.equal(single.k, chunks[0].k)


def test_the_endpoint_forgets_sends_that_completed_or_ran_past_their_deadline() -> None:
    import collections

    from dejavu_worker.endpoint import DataEndpoint
    from dejavulib.handle import Handle

    ep = DataEndpoint.__new__(DataEndpoint)
    ep._inflight = collections.deque()
    done, late, young = Handle.completed(), Handle(8, deadline_s=-1.0), Handle(8, deadline_s=60.0)
    pending = Handle(8, deadline_s=60.0)
    for h in (done, late, young, pending):
        ep._inflight.append((h, None))
    ep._reap()
    assert [h for h, _ in ep._inflight] == [young, pending]  # the young send is still in flight
    young.set_done()
    pending.set_done(RuntimeError("peer gone"))
    ep._reap()
    assert not ep._inflight
