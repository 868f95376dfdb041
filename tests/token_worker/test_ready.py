"""Token stage 0's reading of the READY stream (real Redis): a holder reads only what is announced while it
holds the stage, an announcement of a microbatch that already ended is dropped without waiting, and a
malformed one is dropped without taking the reader down."""

from __future__ import annotations

import logging

import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import FinishReason, MicrobatchSpec, PromptDone, RowSpec, SamplingSpec, TokenStep
from dejavu_token_worker.ready import ReadyMicrobatch, ReadyPrompts


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def _spec(client: redis.Redis, mb_id: int, rows: int = 2) -> MicrobatchSpec:
    spec = MicrobatchSpec(
        mb_id=mb_id,
        rows=tuple(
            RowSpec(request_id=f"r{mb_id}-{i}", prompt_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4, seed=i))
            for i in range(rows)
        ),
        prompt_len=3,
        max_len=7,
    )
    client.set(keys.microbatch(mb_id), spec.encode())
    return spec


def _announce(client: redis.Redis, mb_id: int, rows: tuple[int, int] = (0, 2), token: int = 7, epoch: int = 0) -> None:
    n = rows[1] - rows[0]
    done = PromptDone(mb_id=mb_id, dst_rows=rows, tokens=(token,) * n, finished=(None,) * n, epoch=epoch)
    client.xadd(keys.READY_QUEUE, {"done": done.encode()})


def _pop_logged(ready: ReadyPrompts, caplog) -> tuple[ReadyMicrobatch | None, list[str]]:
    """``ready.pop()`` and what the reader logged meanwhile (warnings and errors)."""
    with caplog.at_level(logging.WARNING, logger="dejavu.token_worker.ready"):
        got = ready.pop()
    return got, [r.getMessage() for r in caplog.records]


def test_a_microbatch_is_ready_once_every_row_has_its_first_token(client) -> None:
    ready = ReadyPrompts(client)
    _spec(client, 1)
    _announce(client, 1, (0, 1), token=5)
    assert ready.pop() is None
    client.xadd(keys.READY_QUEUE, {"done": PromptDone(mb_id=1, dst_rows=(1, 2), tokens=(6,),
                                                      finished=(FinishReason.LENGTH,)).encode()})  # fmt: skip
    got = ready.pop()
    assert got is not None and got.spec.mb_id == 1
    assert got.first_tokens == (5, 6) and got.finished == (None, FinishReason.LENGTH)
    _announce(client, 1)  # announced again (a re-run prompt): already admitted, so ignored
    assert ready.pop() is None


def test_an_announcement_of_a_microbatch_that_ended_is_dropped_without_waiting(client, caplog) -> None:
    """The controller writes a spec before it queues the prompt, so a missing spec means the microbatch
    is gone. The reader must not wait for it: the driver reads announcements between steps, and every
    microbatch this stage runs would wait too (the chaos benchmark saw a new holder sit 10 s on each)."""
    ready = ReadyPrompts(client)
    for mb in (1, 2, 3):
        _announce(client, mb)  # no spec: ended
    _spec(client, 4)
    _announce(client, 4)
    got, logged = _pop_logged(ready, caplog)
    assert got is not None and got.spec.mb_id == 4
    assert sum("it has ended" in m for m in logged) == 3
    # The driver frees what the stages hold of each (their prompt KV can arrive before the microbatch ends).
    assert list(ready.ended) == [1, 2, 3]
    _announce(client, 1)  # another piece of one that ended: ignored, not freed twice
    assert ready.pop() is None and list(ready.ended) == [1, 2, 3]


def test_taking_stage_0_over_again_skips_what_was_announced_meanwhile(client) -> None:
    """A worker serves stage 0, becomes a spare (another holder admits the next microbatches), then takes
    stage 0 back. What was announced in between is the other holder's, or resumes through recovery; read
    again, a microbatch still in flight would be admitted twice."""
    ready = ReadyPrompts(client)
    _spec(client, 1)
    _announce(client, 1)
    assert ready.pop().spec.mb_id == 1
    # Meanwhile, another holder: mb 2 ended, mb 3 is in flight (resumed by the recovery that follows).
    _announce(client, 2)
    _spec(client, 3)
    _announce(client, 3)
    ready.start_over()  # this worker is stage 0's replacement again
    assert ready.pop() is None
    _spec(client, 4)
    _announce(client, 4)
    assert ready.pop().spec.mb_id == 4
    assert ready.pop() is None


def test_a_malformed_announcement_is_dropped_and_reading_goes_on(client, caplog) -> None:
    ready = ReadyPrompts(client)
    _spec(client, 1, rows=2)
    _announce(client, 1, (1, 3))  # rows past the microbatch's
    client.xadd(keys.READY_QUEUE, {"done": b"not a message"})
    client.xadd(keys.READY_QUEUE, {"other": b"field"})
    _spec(client, 2)
    _announce(client, 2)
    got, logged = _pop_logged(ready, caplog)
    assert got is not None and got.spec.mb_id == 2
    assert sum("dropped a ready entry" in m for m in logged) == 3


def test_announcements_of_an_older_epoch_are_dropped_and_of_a_newer_one_wait_for_it(client, caplog) -> None:
    """An older epoch's announcement is stale: its KV was sealed with that epoch and dropped on arrival
    (seen in chaos after Redis restarted empty: admitted, it held stage 0 for 10 s waiting for that KV).
    A newer epoch's is read once this stage serves that epoch, not consumed before and lost to it."""
    ready = ReadyPrompts(client)
    ready.serving(5)
    for mb in (1, 2, 3):
        _spec(client, mb)
    _announce(client, 1, epoch=4)
    _announce(client, 2, epoch=5)
    _announce(client, 3, epoch=6)
    got, logged = _pop_logged(ready, caplog)
    assert got.spec.mb_id == 2 and ready.pop() is None
    assert sum("of epoch 4, before this one (5)" in m for m in logged) == 1
    ready.serving(6)
    assert ready.pop().spec.mb_id == 3
    assert ready.pop() is None


def test_a_microbatch_announced_in_part_fails_after_the_partial_deadline(client) -> None:
    """The prompt task of its other rows was lost (and its re-run too): without a deadline the announced
    rows would wait for the others forever, and their clients until their request timeout."""
    now = [100.0]
    ready = ReadyPrompts(client, partial_deadline_s=120.0, clock=lambda: now[0])
    _spec(client, 1, rows=2)
    _spec(client, 2, rows=2)
    _announce(client, 1, (0, 1), token=5)
    assert ready.pop() is None
    now[0] += 60.0
    _announce(client, 2, (0, 1), token=6)  # a younger partial
    assert ready.pop() is None
    now[0] += 60.5  # microbatch 1 is past its deadline, 2 is not
    got = ready.pop()
    assert got is not None and got.spec.mb_id == 1
    assert got.all_finished and got.finished == (FinishReason.ERROR, FinishReason.ERROR)  # the driver frees it
    ((_, fields),) = client.xrange(keys.tokens(1))  # the controller fails both rows' requests
    step = TokenStep.decode(fields[b"step"])
    assert step.step == 0 and step.finished == (FinishReason.ERROR, FinishReason.ERROR)
    _announce(client, 1, (1, 2), token=7)  # the lost rows after all: too late, ignored
    assert ready.pop() is None
    _announce(client, 2, (1, 2), token=8)  # completed within its deadline: admitted
    got = ready.pop()
    assert got is not None and got.spec.mb_id == 2 and got.first_tokens == (6, 8) and got.finished == (None, None)
    assert client.xlen(keys.tokens(2)) == 0


def test_a_partial_of_a_microbatch_that_ended_expires_without_writing_its_stream(client) -> None:
    now = [0.0]
    ready = ReadyPrompts(client, partial_deadline_s=1.0, clock=lambda: now[0])
    _spec(client, 1, rows=2)
    _announce(client, 1, (0, 1))
    assert ready.pop() is None
    client.delete(keys.microbatch(1))  # the controller gave up on it meanwhile
    now[0] = 2.0
    got = ready.pop()
    assert got is not None and got.all_finished
    assert not client.exists(keys.tokens(1))  # no stream left behind for a microbatch nobody reads
