"""Sampling is a pure function of (seed, step, logits); filters restrict the support; stopping rules."""

from __future__ import annotations

import pytest
import torch

from dejavu_common.messages import FinishReason, SamplingSpec
from dejavu_common.stopping import StopCriteria
from dejavu_engine.sampling import filtered_probs, sample, sample_token

VOCAB = 50
GREEDY = SamplingSpec(max_tokens=16, temperature=0)


def spec(**kwargs: float) -> SamplingSpec:
    return SamplingSpec(max_tokens=16, **kwargs)


def logits_at(step: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(100 + step))


def draw(params: SamplingSpec, steps: range) -> list[int]:
    return [sample_token(logits_at(s), params, s) for s in steps]


def test_seeded_sampling_is_reproducible_and_resumable() -> None:
    params = spec(temperature=1.5, seed=1234)
    full = draw(params, range(40))
    assert full == draw(params, range(40))
    assert full[25:] == draw(params, range(25, 40))  # resumed at step 25 on a "new worker"
    assert full != draw(spec(temperature=1.5, seed=1235), range(40))
    assert len(set(full)) > 3  # really sampling, not collapsing to argmax


def test_unseeded_requests_get_a_seed_at_admission() -> None:
    a, b = spec(temperature=1.0).resolved(), spec(temperature=1.0).resolved()
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a.resolved() == a
    with pytest.raises(ValueError, match="seed"):
        sample_token(logits_at(0), spec(temperature=1.0), 0)


def test_greedy_is_argmax() -> None:
    logits = torch.stack([logits_at(s) for s in range(4)])
    assert sample(logits, [GREEDY] * 4, [0] * 4) == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = logits_at(0)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    params = spec(temperature=5.0, top_k=5, seed=7)
    drawn = {sample_token(logits, params, s) for s in range(300)}
    assert drawn <= allowed and len(drawn) > 1
    assert int((filtered_probs(logits, params) > 0).sum()) == 5


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, spec(temperature=1.0, top_p=0.7, seed=1))
    assert (probs > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[:2], torch.tensor([0.625, 0.375]))
    drawn = {sample_token(logits, spec(temperature=1.0, top_p=0.7, seed=3), s) for s in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
     {"max_tokens": 0}],
)  # fmt: skip
def test_invalid_parameters_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingSpec(**{"max_tokens": 16, **kwargs})  # type: ignore[arg-type]


def test_stop_criteria() -> None:
    stop = StopCriteria(max_tokens=3, eos_token_ids=frozenset({2}), stop_token_ids=frozenset({9}))
    assert stop.check(5, 1) is None
    assert stop.check(2, 1) is FinishReason.STOP
    assert stop.check(9, 2) is FinishReason.STOP
    assert stop.check(5, 3) is FinishReason.LENGTH
    assert StopCriteria(max_tokens=3, eos_token_ids=frozenset({2}), ignore_eos=True).check(2, 1) is None
    with pytest.raises(ValueError):
        StopCriteria(max_tokens=0)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30])
def test_a_vanishing_temperature_samples_the_best_token_instead_of_failing(temperature) -> None:
    # Scaling by 1/temperature overflows to inf (and softmax to NaN) unless the scores are shifted first.
    logits = logits_at(0) * 30
    params = spec(temperature=temperature, seed=7)
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    for s in range(5):
        assert sample_token(logits_at(s) * 30, params, s) == int(torch.argmax(logits_at(s) * 30))


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-8])
@pytest.mark.parametrize("temperature", [0.7, 5e-324])
def test_a_vanishing_top_p_keeps_the_best_token_instead_of_failing(top_p, temperature) -> None:
    # A top_p below float32's smallest value compares as 0 against the float32 cumulative mass: without
    # the first token kept explicitly, every token was dropped and softmax gave NaN (a failed request).
    params = spec(temperature=temperature, top_p=top_p, seed=3)
    for s in range(3):
        logits = logits_at(s) * 5
        probs = filtered_probs(logits, params)
        assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
        assert sample_token(logits, params, s) == int(torch.argmax(logits))
