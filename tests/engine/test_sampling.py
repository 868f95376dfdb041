"""Sampling is a pure function of (seed, step, logits); filters restrict the support; stopping rules."""

from __future__ import annotations

import pytest
import torch

from dejavu_common.messages import LOGPROB_FLOOR, FinishReason, SamplingSpec
from dejavu_common.stopping import StopCriteria
from dejavu_engine.sampling import (
    RowContext,
    filtered_probs,
    process_logits,
    prompt_logprobs,
    sample,
    sample_rows,
    sample_token,
)

VOCAB = 50
GREEDY = SamplingSpec(max_tokens=16, temperature=0)


def spec(**kwargs: object) -> SamplingSpec:
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


# -- sampling controls, against transformers' logits processors and OpenAI's formulas ---------------------


def hf_apply(processor, input_ids: list[int], scores: torch.Tensor) -> torch.Tensor:
    """An HF logits processor over one row (``input_ids``: prompt and generated tokens, as HF's generate sees)."""
    return processor(torch.tensor([input_ids]), scores.clone().unsqueeze(0))[0]


PROMPT = [3, 7, 7, 11, 20]
GENERATED = [7, 30, 30, 30, 41]


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = logits_at(3) * 4
    params = spec(temperature=0, repetition_penalty=penalty)
    ours = process_logits(logits, params, RowContext(PROMPT, GENERATED))
    theirs = hf_apply(RepetitionPenaltyLogitsProcessor(penalty), PROMPT + GENERATED, logits)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def test_frequency_and_presence_penalties_follow_openai_formula() -> None:
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, over generated tokens only.
    logits = logits_at(4)
    params = spec(temperature=0, frequency_penalty=0.6, presence_penalty=-0.4)
    ours = process_logits(logits, params, RowContext(PROMPT, GENERATED))
    expected = logits.clone()
    for j in range(VOCAB):
        c = GENERATED.count(j)
        expected[j] -= c * 0.6 + float(c > 0) * -0.4
    torch.testing.assert_close(ours, expected)
    assert ours[3] == logits[3]  # a prompt token that was not generated is not penalised


def test_min_tokens_masks_stop_ids_like_transformers() -> None:
    from transformers import MinNewTokensLengthLogitsProcessor

    logits = logits_at(5)
    eos, stop = 2, 9
    params = spec(temperature=0, min_tokens=3, stop_token_ids=(stop,))
    stop_ids = StopCriteria.of(params, {eos}).stop_ids
    for generated in ([], [5], [5, 6], [5, 6, 7]):
        ours = process_logits(logits, params, RowContext(PROMPT, generated, stop_ids))
        hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, [eos, stop])
        torch.testing.assert_close(ours, hf_apply(hf, PROMPT + generated, logits))
    # ignore_eos: EOS does not stop the row, so min_tokens leaves it sampleable; stop tokens stay masked
    relaxed = StopCriteria.of(spec(temperature=0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=True), {eos})
    masked = process_logits(logits, params, RowContext(PROMPT, [], relaxed.stop_ids))
    assert masked[eos] == logits[eos] and masked[stop] == float("-inf")


def test_stop_criteria_wait_for_min_tokens() -> None:
    stop = StopCriteria.of(SamplingSpec(max_tokens=5, min_tokens=2), {2})
    assert stop.check(2, 1) is None and stop.check(2, 2) is None and stop.check(2, 3) is FinishReason.STOP


def test_logit_bias_adds_like_transformers_and_100_bans_or_forces() -> None:
    from transformers import SequenceBiasLogitsProcessor

    logits = logits_at(6)
    bias = ((1, 2.5), (4, -3.0), (17, 0.25))
    ours = process_logits(logits, spec(temperature=0, logit_bias=bias))
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})
    torch.testing.assert_close(ours, hf_apply(hf, PROMPT, logits))
    best = int(logits.argmax())
    banned = process_logits(logits, spec(temperature=0, logit_bias=((best, -100.0),)))
    assert banned[best] == float("-inf")
    assert sample_token(logits, spec(temperature=0, logit_bias=((best, -100.0),)), 0) != best
    forced = spec(temperature=1.5, seed=3, logit_bias=((13, 100.0), (21, 100.0)))
    assert {sample_token(logits_at(s), forced, s) for s in range(50)} == {13, 21}
    lp = sample_rows(logits.unsqueeze(0), [forced.model_copy(update={"logprobs": 3})], [0])[0].logprob
    assert lp is not None and {t for t, _ in lp.top[:2]} == {13, 21} and lp.top[2][1] == LOGPROB_FLOOR


def test_a_forced_stop_token_masked_by_min_tokens_does_not_force() -> None:
    # Forcing a token that min_tokens masks would leave nothing to sample: the bias gives way instead.
    params = spec(temperature=0, min_tokens=2, logit_bias=((2, 100.0),))
    out = process_logits(logits_at(7), params, RowContext([], [], frozenset({2})))
    assert out[2] == float("-inf") and torch.isfinite(out).sum() == VOCAB - 1


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_and_top_k_keep_what_transformers_keeps(min_p: float) -> None:
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    logits = logits_at(8) * 3
    params = spec(temperature=0.8, min_p=min_p, top_k=12, seed=1)
    scores = hf_apply(TemperatureLogitsWarper(0.8), PROMPT, logits)
    scores = hf_apply(TopKLogitsWarper(12), PROMPT, scores)
    scores = hf_apply(MinPLogitsWarper(min_p), PROMPT, scores)
    torch.testing.assert_close(filtered_probs(logits, params), scores.softmax(-1))


def test_penalised_draws_resume_from_the_same_history() -> None:
    # A resumed row rebuilds its generated tokens from its stream: the same context gives the same draws.
    params = spec(temperature=1.0, seed=99, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    history: list[int] = []
    for s in range(30):
        history.append(sample_token(logits_at(s), params, s, RowContext(PROMPT, list(history))))
    resumed = history[:12]
    for s in range(12, 30):
        resumed.append(sample_token(logits_at(s), params, s, RowContext(PROMPT, list(resumed))))
    assert resumed == history
    unpenalised = [sample_token(logits_at(s), spec(temperature=1.0, seed=99), s) for s in range(30)]
    assert unpenalised != history


def test_logprobs_are_the_log_softmax_of_the_processed_logits() -> None:
    logits = torch.stack([logits_at(s) for s in range(3)])
    params = [spec(temperature=0, logprobs=4), spec(temperature=0, logprobs=0, presence_penalty=1.0), GREEDY]
    contexts = [RowContext(), RowContext((), [int(logits[1].argmax())]), RowContext()]
    rows = sample_rows(logits, params, [0, 0, 0], contexts)
    expected = torch.log_softmax(logits[0], -1)
    assert rows[0].token == int(logits[0].argmax()) and rows[0].logprob is not None
    assert rows[0].logprob.logprob == pytest.approx(float(expected.max()), abs=1e-6)
    top = torch.topk(expected, 4)
    assert [t for t, _ in rows[0].logprob.top] == top.indices.tolist()
    assert [v for _, v in rows[0].logprob.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    penalised = torch.log_softmax(process_logits(logits[1], params[1], contexts[1]), -1)
    assert rows[1].logprob is not None and rows[1].logprob.top == ()
    assert rows[1].logprob.logprob == pytest.approx(float(penalised[rows[1].token]), abs=1e-6)
    assert rows[2].logprob is None


def test_raw_logprobs_are_the_model_s_own() -> None:
    logits = logits_at(9).unsqueeze(0)
    penalised = spec(temperature=0, frequency_penalty=2.0, logprobs=1)
    context = [RowContext((), [int(logits[0].argmax())] * 3)]
    processed = sample_rows(logits, [penalised], [0], context)[0]
    raw = sample_rows(logits, [penalised.model_copy(update={"raw_logprobs": True})], [0], context)[0]
    assert raw.token == processed.token  # the same choice; only what is reported differs
    assert raw.logprob is not None and processed.logprob is not None
    assert raw.logprob.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[raw.token]), abs=1e-6)
    assert raw.logprob.logprob != pytest.approx(processed.logprob.logprob)


def test_a_plain_greedy_batch_stays_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    import dejavu_engine.sampling as sampling

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a plain greedy batch must not be processed row by row")

    monkeypatch.setattr(sampling, "process_logits", refuse)
    logits = torch.stack([logits_at(s) for s in range(4)])
    assert [r.token for r in sample_rows(logits, [GREEDY] * 4, [0] * 4)] == logits.argmax(-1).tolist()


def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before() -> None:
    logits = torch.stack([logits_at(s) for s in range(4)])
    ids = [5, 9, 1, 30]
    out = prompt_logprobs(logits, ids, 2)
    assert out[0] is None and len(out) == 4
    for i in range(1, 4):
        lp = out[i]
        assert lp is not None and len(lp.top) == 2
        assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[i - 1], -1)[ids[i]]), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"repetition_penalty": 0.0}, {"repetition_penalty": 2.5},
     {"min_p": 1.5}, {"min_tokens": 17}, {"logprobs": 21}, {"prompt_logprobs": -1}, {"logit_bias": ((3, 101.0),)},
     {"logit_bias": ((5, 1.0), (3, 1.0))}, {"logit_bias": ((-1, 1.0),)}],
)  # fmt: skip
def test_invalid_controls_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingSpec(**{"max_tokens": 16, **kwargs})  # type: ignore[arg-type]
