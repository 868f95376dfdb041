"""Row progress at a sampling stage: finishes, -1 for finished rows, replay after a failure."""

from __future__ import annotations

import pytest

from dejavu_common.messages import FinishReason, Logprob, MicrobatchSpec, RowSpec, SamplingSpec, TokenStep
from dejavu_worker.rows import RowTracker

EOS = 2


def _spec(max_tokens: list[int], prompt_len: int = 4, stop_ids=()) -> MicrobatchSpec:
    rows = tuple(
        RowSpec(
            request_id=f"r{i}",
            prompt_ids=(1,) * prompt_len,
            sampling=SamplingSpec(max_tokens=m, seed=i, stop_token_ids=tuple(stop_ids)),
        )
        for i, m in enumerate(max_tokens)
    )
    return MicrobatchSpec(mb_id=7, rows=rows, prompt_len=prompt_len, max_len=prompt_len + max(max_tokens))


def test_eos_length_stop_token_and_cancel() -> None:
    t = RowTracker(_spec([3, 5, 5, 5], stop_ids=[9]), eos_ids=frozenset({EOS}))
    e0 = t.step(0, [10, 11, 12, 13])
    assert e0.tokens == (10, 11, 12, 13) and e0.finished == (None,) * 4
    e1 = t.step(1, [10, EOS, 9, 13], cancelled={3})
    assert e1.tokens == (10, EOS, 9, -1)
    assert e1.finished == (None, FinishReason.STOP, FinishReason.STOP, FinishReason.CANCELLED)
    e2 = t.step(2, [10, 10, 10, 10])
    assert e2.tokens == (10, -1, -1, -1)
    assert e2.finished == (FinishReason.LENGTH, None, None, None)
    assert t.done


def test_partial_rows_for_prompt_pieces() -> None:
    t = RowTracker(_spec([4, 4, 4]), eos_ids=frozenset({EOS}))
    e = t.step(0, [5, 6], rows=[1, 2])
    assert e.tokens == (-1, 5, 6)
    assert t.generated == [0, 1, 1]


def test_replay_rebuilds_state() -> None:
    spec = _spec([3, 2])
    a = RowTracker(spec, eos_ids=frozenset({EOS}))
    history = [a.step(0, [5, 6]), a.step(1, [5, 6])]
    b = RowTracker(spec, eos_ids=frozenset({EOS}))
    b.replay(history)
    assert b.generated == a.generated and b.finished == a.finished
    assert b.outputs == a.outputs == [[5, 5], [6, 6]]  # what the rows' penalties read
    assert b.step(2, [7, 7]) == a.step(2, [7, 7])


def test_entries_carry_log_probabilities_of_the_rows_that_emit() -> None:
    t = RowTracker(_spec([4, 4, 4]), eos_ids=frozenset({EOS}))
    lp = [Logprob(logprob=-0.5, top=((5, -0.5),)), Logprob(logprob=-1.0), None]
    prompt = [(None, Logprob(logprob=-2.0)), None, None]
    e = t.step(0, [5, 6, 7], cancelled={1}, logprobs=lp, prompt_logprobs=prompt)
    assert e.logprobs == (lp[0], None, None) and e.prompt_logprobs == (prompt[0], None, None)
    assert TokenStep.decode(e.encode()) == e
    plain = t.step(1, [5, 7], rows=[0, 2])
    assert plain.logprobs == () and plain.prompt_logprobs == ()  # no row reports any: the old entry shape


def test_ignore_eos_keeps_the_row_going_but_stop_tokens_still_stop() -> None:
    rows = tuple(
        RowSpec(
            request_id=f"r{i}",
            prompt_ids=(1, 1, 1, 1),
            sampling=SamplingSpec(max_tokens=3, seed=i, stop_token_ids=(9,), ignore_eos=ignore),
        )
        for i, ignore in enumerate((True, True, False))
    )
    t = RowTracker(MicrobatchSpec(mb_id=3, rows=rows, prompt_len=4, max_len=7), eos_ids=frozenset({EOS}))
    e0 = t.step(0, [EOS, EOS, EOS])
    assert e0.tokens == (EOS, EOS, EOS) and e0.finished == (None, None, FinishReason.STOP)
    e1 = t.step(1, [EOS, 9, 5])
    assert e1.tokens == (EOS, 9, -1) and e1.finished == (None, FinishReason.STOP, None)
    e2 = t.step(2, [EOS, 5, 5])
    assert e2.finished == (FinishReason.LENGTH, None, None)  # max_tokens reached past two EOS
    assert t.done and t.generated == [3, 2, 1]


def test_sampling_spec_carries_ignore_eos_and_old_messages_decode() -> None:
    spec = SamplingSpec(max_tokens=4, seed=1, ignore_eos=True)
    assert SamplingSpec.decode(spec.encode()) == spec
    old = b'{"v": 1, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 1, "stop_token_ids": []}'
    assert SamplingSpec.decode(old).ignore_eos is False


def test_a_step_with_log_probabilities_for_other_rows_than_its_tokens_is_malformed() -> None:
    with pytest.raises(ValueError):
        TokenStep(mb_id=1, step=0, tokens=(5, 6), finished=(None, None), logprobs=(Logprob(logprob=-1.0),))
    with pytest.raises(ValueError):
        TokenStep.decode(b'{"mb_id": 1, "step": 0, "tokens": [5], "finished": [null], "prompt_logprobs": [null, null]}')
