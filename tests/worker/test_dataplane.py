"""Framing of stage messages and token returns (no pickle; typed, versioned, strict decoding); KV moves
through DejaVuLib."""

from __future__ import annotations

import pytest
import torch

from dejavu_common.messages import SCHEMA_VERSION, PromptPiece, PromptTask
from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn, frame, unframe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_stage_message_round_trip(dtype) -> None:
    x = (torch.randn(2, 3, 5) * 100).to(dtype)
    task = PromptTask(task_id=4, pieces=(PromptPiece(mb_id=3, dst_rows=(0, 2)),), epoch=2)
    msg = StageMessage(Kind.PREFILL, mb_id=4, step=0, tensor=x, task=task, entry="17-0")
    back = StageMessage.decode(msg.encode())
    assert (back.kind, back.mb_id, back.step, back.task, back.entry) == (Kind.PREFILL, 4, 0, task, "17-0")
    assert back.tensor.dtype == dtype and torch.equal(back.tensor, x)
    hinted = StageMessage.decode(StageMessage(Kind.DECODE, 1, 0, x, next_mb=2).encode())
    assert (hinted.next_mb, hinted.task, hinted.entry) == (2, None, None)


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
    [
        b"",
        b"\x05\x00\x00\x00{}",
        b"\x02\x00\x00\x00[]",
        frame({"dtype": "float32", "shape": [4]}, None) + b"\x00" * 3,
        frame({"dtype": "complex64", "shape": [1]}, None) + b"\x00" * 8,
        frame({"dtype": "float32", "shape": "4"}, None) + b"\x00" * 16,
    ],
)
def test_malformed_payloads_raise_value_error(payload) -> None:
    with pytest.raises(ValueError):
        unframe(payload)


def test_the_meta_is_versioned_and_strict() -> None:
    """Every stage message and token return names its schema version, and a payload of another shape
    (an unknown field, a wrong type, a tensor where none belongs) raises ValueError for its receiver to
    drop, never another exception that would end a worker's loop."""
    x = torch.zeros(1, 1, 4)
    meta, _ = unframe(StageMessage(Kind.DECODE, 0, 3, x).encode())
    assert meta["v"] == SCHEMA_VERSION
    assert unframe(TokenReturn(0, (Returned(1, 2, (3,), False),)).encode())[0]["v"] == SCHEMA_VERSION
    bad = [
        frame({"kind": "decode", "mb": 0, "step": 1, "shiny": True}, x),  # unknown field
        frame({"kind": "decode", "mb": "zero", "step": 1}, x),  # wrong type
        frame({"kind": "teleport", "mb": 0, "step": 1}, x),  # no such kind
        frame({"mb": 0, "step": 1}, x),  # no kind
        frame({"kind": "decode", "mb": 0, "step": 1, "members": [[1, 2]]}, x),  # a member without its rows
    ]
    for payload in bad:
        with pytest.raises(ValueError):
            StageMessage.decode(payload)
    for payload in (
        frame({"cohort": 0, "members": [[1, 2, [3], False, None, False]]}, x),  # a tensor where none belongs
        frame({"cohort": 0, "members": [[1, 2, [3], False]]}, None),  # a member cut short
        frame({"cohort": 0}, None),
    ):
        with pytest.raises(ValueError):
            TokenReturn.decode(payload)
