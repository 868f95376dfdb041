"""Framing of stage messages and token returns (no pickle, strict decoding); KV moves through DejaVuLib."""

from __future__ import annotations

import pytest
import torch

from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn, frame, unframe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_stage_message_round_trip(dtype) -> None:
    x = (torch.randn(2, 3, 5) * 100).to(dtype)
    msg = StageMessage(Kind.DECODE, mb_id=3, step=17, tensor=x, meta={"task": {"a": 1}})
    back = StageMessage.decode(msg.encode())
    assert (back.kind, back.mb_id, back.step, back.meta) == (Kind.DECODE, 3, 17, {"task": {"a": 1}})
    assert back.tensor.dtype == dtype and torch.equal(back.tensor, x)


def test_token_return_round_trip() -> None:
    ret = TokenReturn(cohort=1, members=(Returned(3, 4, (5, 0, 7), False, (0, 2)), Returned(9, 1, (2,), True)))
    assert TokenReturn.decode(ret.encode()) == ret
    x = torch.randn(3, 1, 8)
    cohort = StageMessage(Kind.DECODE, mb_id=0, step=0, tensor=x, members=((3, 4, (0, 2)), (9, 1, (0,))))
    assert StageMessage.decode(cohort.encode()).members == ((3, 4, (0, 2)), (9, 1, (0,)))
    # Members a stage set aside to be recomputed ride the pass to the last stage, then back to stage 0.
    deferred = StageMessage(Kind.DECODE, mb_id=0, step=0, tensor=x, members=((3, 4, (0, 2)),), deferred=((9, 1),))
    assert StageMessage.decode(deferred.encode()).deferred == ((9, 1),)
    assert StageMessage.decode(cohort.encode()).deferred == ()
    back = TokenReturn(cohort=0, members=(Returned(3, 4, (5, 7), False), Returned(9, 1, (), False, None, True)))
    assert TokenReturn.decode(back.encode()) == back and TokenReturn.decode(back.encode()).members[1].recompute


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00[]", frame({"dtype": "float32", "shape": [4]}, None) + b"\x00" * 3],
)
def test_malformed_payloads_raise_value_error(payload) -> None:
    with pytest.raises(ValueError):
        unframe(payload)
