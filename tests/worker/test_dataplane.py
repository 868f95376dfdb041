"""Framing of stage messages, token returns and prompt KV chunks (no pickle, strict decoding)."""

from __future__ import annotations

import pytest
import torch

from dejavu_worker.dataplane import Kind, KVChunk, StageMessage, TokenReturn, frame, unframe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_stage_message_round_trip(dtype) -> None:
    x = (torch.randn(2, 3, 5) * 100).to(dtype)
    msg = StageMessage(Kind.DECODE, mb_id=3, step=17, tensor=x, meta={"task": {"a": 1}})
    back = StageMessage.decode(msg.encode())
    assert (back.kind, back.mb_id, back.step, back.meta) == (Kind.DECODE, 3, 17, {"task": {"a": 1}})
    assert back.tensor.dtype == dtype and torch.equal(back.tensor, x)


def test_token_return_and_kv_chunk_round_trip() -> None:
    ret = TokenReturn(mb_id=1, step=4, tokens=(5, 0, 7), done=False)
    assert TokenReturn.decode(ret.encode()) == ret
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
