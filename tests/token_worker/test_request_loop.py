"""The request-scheduled token stage (:class:`RequestLoop`) in-process over a real Redis and the real default model:
colocated tasks are queued as the controller queues them (a one-row microbatch spec, then a task on the colocated
stream), the loop plans, computes and publishes, and every token stream is read back from Redis and checked against
transformers' greedy ``generate`` (and its prompt log-softmax): prompts of many lengths chunked under a small token
budget, prefix-cache hits, a pool too small for the work (recompute preemption), cancellations, token writes Redis
does not take, requests resumed from their token streams (after a broken pass, a recovery's drop, a repair), tasks
that are not one request, a request longer than the pool or than its context, and prompt log probabilities."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from engine.tiny_models import build_checkpoint
from transformers import AutoModelForCausalLM

from dejavu_common import keys
from dejavu_common.messages import (
    FinishReason,
    MicrobatchSpec,
    PromptPiece,
    PromptTask,
    RowSpec,
    SamplingSpec,
    TokenStep,
)
from dejavu_common.sched import FREED, BlockBook, Budget, ScheduledPass, Scheduler, most_blocks
from dejavu_common.signing import token_entry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import PassLogits, SliceExecutor
from dejavu_token_worker.loop import RequestLoop
from dejavu_token_worker.runner import history
from dejavu_worker.metrics import WorkerMetrics

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = pytest.mark.model

BLOCK = 16
DEADLINE_S = 60.0  # a loop that stops making progress fails the test instead of hanging it


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage(folder: Path) -> Stage:
    """The whole default model as one float32 stage, the stage a colocated one-stage pipeline serves."""
    stage = Pipeline(folder, 1, "cpu", "float32").stages[0]
    if not stage.paged_attention:
        pytest.skip("the request loop needs the native paged attention kernels (see request_stage.schedules_requests)")
    return stage


class Reference:
    """transformers' float32 model of the same checkpoint: greedy continuations (cached) and prompt logits."""

    def __init__(self, folder: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.eos = frozenset({int(self.model.generation_config.eos_token_id)})
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: Iterable[int], n: int) -> list[int]:
        """transformers' greedy tokens after ``prompt``: ``n`` of them, or fewer ending at EOS."""
        key = (tuple(prompt), n)
        if key not in self._greedy:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([key[0]]), max_new_tokens=n, do_sample=False)
            self._greedy[key] = out[0, len(key[0]) :].tolist()
        return self._greedy[key]

    def expected(self, prompt: Iterable[int], sampling: SamplingSpec) -> tuple[list[int], FinishReason]:
        """The stream a greedy request must deliver: transformers' tokens up to the first stop (an EOS or one of
        its stop tokens: ``stop``), else ``max_tokens`` of them (``length``)."""
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos))
        tokens = self.greedy(prompt, sampling.max_tokens)
        for i, token in enumerate(tokens):
            if token in stops:
                return tokens[: i + 1], FinishReason.STOP
        assert len(tokens) == sampling.max_tokens, "transformers stopped at a token the serving stack ignores"
        return tokens, FinishReason.LENGTH

    def prompt_log_probs(self, prompt: list[int]) -> torch.Tensor:
        """``[len(prompt) - 1, vocab]``: the log-softmax after each position but the last (it predicts the next)."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1)


@pytest.fixture(scope="module")
def reference(folder: Path, stage: Stage) -> Reference:
    ref = Reference(folder)
    assert ref.eos == stage.spec.eos_token_ids, "transformers and the stage stop at the same EOS"
    return ref


# -- helpers ----------------------------------------------------------------------------------------


def _loop(
    client: redis.Redis,
    stage: Stage,
    blocks: int = 64,
    tokens: int = 32,
    max_running: int = 8,
    caching: bool = True,
    max_recomputes: int = 8,
) -> RequestLoop:
    """A loop built as ``request_stage.request_loop`` builds it, over a pool of ``blocks`` blocks of ``BLOCK`` (the
    stage's sliding window, if every layer has one, gives back the blocks out of it)."""
    pool = stage.block_pool(BLOCK, blocks, slab_blocks=16)
    book = BlockBook(pool.max_blocks, BLOCK, b"SmolLM2-135M|float32|16", caching=caching)
    scheduler = Scheduler(book, Budget(tokens=tokens, max_running=max_running), stage.kv_window)
    metrics = WorkerMetrics("t0", "token")
    emitter = Emitter(client, None, stage.spec.eos_token_ids)
    return RequestLoop(scheduler, SliceExecutor(stage, pool), client, "t0", metrics, emitter, [], max_recomputes)


def _spec(mb: int, prompt: list[int], sampling: SamplingSpec, rows: int = 1) -> MicrobatchSpec:
    row = RowSpec(request_id=f"r{mb}", prompt_ids=tuple(prompt), sampling=sampling)
    return MicrobatchSpec(
        mb_id=mb, rows=(row,) * rows, prompt_len=len(prompt), max_len=len(prompt) + sampling.max_tokens
    )


def _queue(client: redis.Redis, spec: MicrobatchSpec, dst_rows: tuple[int, int] = (0, 1)) -> None:
    """What the controller does for a colocated request: its spec first, then its task on the colocated stream."""
    client.set(keys.microbatch(spec.mb_id), spec.encode())
    task = PromptTask(task_id=spec.mb_id, pieces=(PromptPiece(mb_id=spec.mb_id, dst_rows=dst_rows),), epoch=0)
    client.xadd(keys.COLOCATED_QUEUE, {"task": task.encode()})


def _entries(client: redis.Redis, mb: int) -> list[TokenStep]:
    """Every entry of ``mb``'s token stream as written, duplicates included."""
    return [TokenStep.decode(fields[b"step"]) for _, fields in client.xrange(keys.tokens(mb))]


def _finished(client: redis.Redis, mb: int) -> bool:
    return any(f is not None for e in _entries(client, mb) for f in e.finished)


def _bounded(done: Callable[[], bool], what: str) -> Callable[[], bool]:
    """The loop's ``stop``: ``done()``; past ``DEADLINE_S`` it raises instead (a loop that makes no progress fails
    the test rather than hanging it)."""
    end = time.monotonic() + DEADLINE_S

    def stop() -> bool:
        if done():
            return True
        if time.monotonic() > end:
            raise AssertionError(f"not done after {DEADLINE_S} s: {what}")
        return False

    return stop


def _until(loop: RequestLoop, mbs: Iterable[int], then: Callable[[], None] | None = None) -> Callable[[], bool]:
    """A bounded ``stop`` that is true once every stream of ``mbs`` has its finish, or once the loop has nothing
    left to serve (no request, no task held or queued: a stream left unfinished then fails the test at once).
    ``then`` runs at every check first (a test's own actions between passes)."""
    mbs, client = list(mbs), loop.redis

    def done() -> bool:
        if then is not None:
            then()
        if all(_finished(client, mb) for mb in mbs):
            return True
        (group,) = client.xinfo_groups(keys.COLOCATED_QUEUE)
        return not loop.requests.served and not loop.queue.held and group["lag"] == 0

    return _bounded(done, f"streams of microbatches {mbs} finished")


@dataclass(frozen=True)
class Stream:
    tokens: list[int]
    finish: FinishReason | None


def _stream(client: redis.Redis, mb: int) -> Stream:
    """``mb``'s delivered tokens and finish; its entries are steps 0, 1, ... each exactly once, the last one
    (only) carrying the finish."""
    entries = _entries(client, mb)
    assert [e.step for e in entries] == list(range(len(entries))), f"microbatch {mb}: steps {[e.step for e in entries]}"
    assert all(len(e.tokens) == 1 for e in entries)
    assert all(e.finished == (None,) for e in entries[:-1]), f"microbatch {mb} goes on after its finish"
    merged = history(client, mb, before_step=1 << 30)
    assert [e.step for e in merged] == [e.step for e in entries]
    tokens = [e.tokens[0] for e in entries if e.tokens[0] >= 0]
    assert all(e.tokens[0] >= 0 for e in entries[:-1]), f"microbatch {mb} skipped a token"
    return Stream(tokens, entries[-1].finished[0] if entries else None)


def _assert_exact(
    client: redis.Redis, reference: Reference, mb: int, prompt: list[int], sampling: SamplingSpec
) -> None:
    tokens, finish = reference.expected(prompt, sampling)
    assert _stream(client, mb) == Stream(tokens, finish), f"microbatch {mb}"


def _passes(loop: RequestLoop) -> list[list[tuple[str, int, int]]]:
    """Records, from now on, every pass the loop's executor computes: ``(request, start, length)`` per slice."""
    passes: list[list[tuple[str, int, int]]] = []
    run = loop.executor.run

    def recording(step: ScheduledPass, every: Collection[int] = ()) -> PassLogits:
        passes.append([(s.request.request_id, s.start, s.length) for s in step.slices])
        return run(step, every)

    loop.executor.run = recording  # type: ignore[method-assign]
    return passes


def _all_free(loop: RequestLoop) -> bool:
    book = loop.scheduler.book
    return book.free == book.num_blocks and not loop.requests.served and len(loop.scheduler) == 0


def _assert_prompt_logprobs(reported: tuple | None, prompt: list[int], reference: Reference, top: int) -> None:
    """``reported`` (a step-0 entry's row) holds every prompt position's log probability and ``top`` most likely
    tokens, transformers' within 1e-4 (None for position 0, which nothing predicts)."""
    assert reported is not None and len(reported) == len(prompt) and reported[0] is None
    missing = [p for p, lp in enumerate(reported) if p and lp is None]
    assert not missing, f"positions {missing} have no log probabilities"
    expected = reference.prompt_log_probs(prompt)
    got = torch.tensor([lp.logprob for lp in reported[1:]])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for p, lp in enumerate(reported[1:]):
        values, ids = torch.topk(expected[p], top)
        assert [t for t, _ in lp.top] == ids.tolist(), p
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)


GREEDY = SamplingSpec(max_tokens=4, temperature=0)


# -- tests ------------------------------------------------------------------------------------------


def test_prompts_of_many_lengths_chunked_under_a_small_budget_deliver_transformers_greedy_tokens(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """Prompts of 3 to 150 tokens queued together with a budget of 32 positions a pass: long ones are computed in
    block-aligned chunks beside the others' decodes; one stops on a stop token (``stop``), the rest at
    ``max_tokens`` (``length``)."""
    cases: dict[int, tuple[list[int], SamplingSpec]] = {}
    for mb, (offset, length, max_tokens) in enumerate(
        [(0, 3, 4), (5, 150, 5), (40, 17, 3), (70, 45, 6), (100, 9, 1)], start=1
    ):
        cases[mb] = (text_ids[offset : offset + length], SamplingSpec(max_tokens=max_tokens, temperature=0))
    # One request ends on a stop token: its 3rd greedy token.
    prompt, _ = cases[4]
    stop_at = reference.greedy(prompt, 6)[2]
    cases[4] = (prompt, SamplingSpec(max_tokens=6, temperature=0, stop_token_ids=(stop_at,)))
    loop = _loop(client, stage)
    for mb, (prompt, sampling) in cases.items():
        _queue(client, _spec(mb, prompt, sampling))
    passes = _passes(loop)
    loop.run(_until(loop, cases))
    for mb, (prompt, sampling) in cases.items():
        _assert_exact(client, reference, mb, prompt, sampling)
    assert _stream(client, 4).finish is FinishReason.STOP and _stream(client, 2).finish is FinishReason.LENGTH
    tokens = [sum(n for _, _, n in slices) for slices in passes]
    assert max(tokens) <= 32 and sum(tokens) >= sum(len(p) for p, _ in cases.values())  # chunked, nothing skipped
    # The 150-token prompt: consecutive chunks from 0 to 150, each but the last ending on a block boundary.
    chunks = [(start, n) for slices in passes for rid, start, n in slices if rid == "2" and start < 150]
    assert len(chunks) >= 5 and chunks[0][0] == 0 and sum(n for _, n in chunks) == 150
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(chunks)) and all(
        (a + n) % BLOCK == 0 for a, n in chunks[:-1]
    )
    assert _all_free(loop)


@pytest.mark.parametrize("caching", [True, False])
def test_a_request_sharing_a_cached_prefix_skips_it_and_delivers_the_same_tokens(
    caching: bool, client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """The second of two requests sharing a 64-token prefix (4 blocks), queued after the first finished, finds
    those blocks in the prefix cache (64 hit tokens) and computes only its own suffix; its stream is exact. With
    caching off nothing is found and the streams are the same."""
    prefix = text_ids[:64]
    first, second = prefix + text_ids[100:120], prefix + text_ids[150:165]
    assert first[64] != second[64]
    loop = _loop(client, stage, caching=caching)
    _queue(client, _spec(1, first, GREEDY))
    loop.run(_until(loop, [1]))
    passes = _passes(loop)
    _queue(client, _spec(2, second, GREEDY))
    loop.run(_until(loop, [2]))
    _assert_exact(client, reference, 1, first, GREEDY)
    _assert_exact(client, reference, 2, second, GREEDY)
    stats = loop.scheduler.book.stats()
    if caching:
        assert stats.hits == 64 and passes[0] == [("2", 64, 15)]  # its suffix alone, past the cached prefix
    else:
        assert stats.hits == 0 and passes[0] == [("2", 0, 32)]
    assert _all_free(loop)


def _crowded(text_ids: list[int]) -> tuple[dict[int, list[int]], SamplingSpec]:
    """Three requests of 30-token prompts and 6 tokens each: 3 blocks apiece once they decode past position 32."""
    return {mb: text_ids[30 * mb : 30 * mb + 30] for mb in range(1, 4)}, SamplingSpec(max_tokens=6, temperature=0)


def test_a_pool_too_small_for_all_requests_preempts_and_recomputes_and_every_stream_is_exact(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """The crowded requests in a pool of 5 blocks: as the first two decode into their third block, the one admitted
    later is preempted (its blocks back) and recomputed once there is room, from its prompt and the tokens it
    delivered: every stream is still exactly transformers' greedy one."""
    prompts, sampling = _crowded(text_ids)
    loop = _loop(client, stage, blocks=5, max_recomputes=8)
    preempted: list[str] = []
    schedule = loop.scheduler.schedule

    def spy():
        step = schedule()
        preempted.extend(r.request_id for r in step.preempted)
        return step

    loop.scheduler.schedule = spy  # type: ignore[method-assign]
    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    with caplog.at_level("INFO", logger="dejavu.token_worker.loop"):
        loop.run(_until(loop, prompts))
    assert preempted and "to be recomputed" in caplog.text
    for mb, prompt in prompts.items():
        _assert_exact(client, reference, mb, prompt, sampling)
    assert _all_free(loop)


def test_with_no_recomputes_allowed_a_preempted_request_fails_alone(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """``max_recomputes=0``: the preempted request ends with an ``error`` finish right after the tokens it
    delivered (each of them exact); the others deliver exactly transformers' tokens."""
    prompts, sampling = _crowded(text_ids)
    loop = _loop(client, stage, blocks=5, max_recomputes=0)
    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    loop.run(_until(loop, prompts))
    failed = [mb for mb in prompts if _stream(client, mb).finish is FinishReason.ERROR]
    assert failed and len(failed) < len(prompts)
    for mb, prompt in prompts.items():
        stream, (tokens, finish) = _stream(client, mb), reference.expected(prompt, sampling)
        if mb in failed:
            assert stream.tokens == tokens[: len(stream.tokens)] and len(stream.tokens) < len(tokens)
        else:
            assert stream == Stream(tokens, finish)
    assert _all_free(loop)


def test_a_cancelled_request_ends_cancelled_and_gives_its_blocks_back(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """Request 1 is cancelled before it is taken, request 2 once it delivered 2 tokens (between passes), request 3
    while a pass computes its next token: each ends with ``cancelled`` after what it delivered (exact so far), the
    untouched request 4 is exact, and the pool has every block free again."""
    sampling = SamplingSpec(max_tokens=8, temperature=0)
    prompts = {mb: text_ids[20 * mb : 20 * mb + 20] for mb in range(1, 5)}
    client.sadd(keys.microbatch_cancel(1), 0)
    loop = _loop(client, stage)
    run = loop.executor.run

    def cancelling(step, every=()):  # request 3 is cancelled during the pass that computes its 4th token
        out = run(step, every)
        if any(s.request.request_id == "3" and s.samples for s in step.slices) and len(_entries(client, 3)) == 3:
            client.sadd(keys.microbatch_cancel(3), 0)
        return out

    loop.executor.run = cancelling  # type: ignore[method-assign]

    def cancel_2() -> None:
        if len(_entries(client, 2)) == 2:
            client.sadd(keys.microbatch_cancel(2), 0)

    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    loop.run(_until(loop, prompts, then=cancel_2))
    delivered = {1: 0, 2: 2, 3: 3}
    for mb, n in delivered.items():
        tokens, _ = reference.expected(prompts[mb], sampling)
        assert _stream(client, mb) == Stream(tokens[:n], FinishReason.CANCELLED), mb
    _assert_exact(client, reference, 4, prompts[4], sampling)
    assert _all_free(loop)


class _Pipeline:
    """A Redis pipeline that writes tokens as the real one does until ``plan["left"]`` such writes succeeded; the
    next one fails: Redis refuses it (``plan["written"]`` false: nothing reaches the stream), or the reply is lost
    after Redis applied it (true). Pipelines that write nothing (the cancellation checks) are left alone."""

    def __init__(self, real: redis.client.Pipeline, plan: dict[str, int | bool]) -> None:
        self.real, self.plan, self.writes = real, plan, False

    def xadd(self, *args: object, **kwargs: object) -> object:
        self.writes = True
        return self.real.xadd(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def execute(self) -> list[object]:
        if not self.writes or self.plan["left"] < 0:
            return self.real.execute()
        self.plan["left"] -= 1
        if self.plan["left"] >= 0:
            return self.real.execute()
        if self.plan["written"]:
            self.real.execute()
            raise redis.exceptions.ConnectionError("connection lost reading the reply")
        self.real.reset()
        raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'")


@pytest.mark.parametrize("written", [False, True], ids=["refused", "reply-lost"])
def test_a_pass_whose_tokens_redis_does_not_take_breaks_run_and_the_next_run_continues_exactly(
    written: bool,
    client: redis.Redis,
    stage: Stage,
    reference: Reference,
    text_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 4th token write fails: ``run`` raises. Called again, the loop restarts that pass's requests from their
    token streams, so every stream ends exact, each step written exactly once (whether or not the failed write
    reached Redis)."""
    sampling = SamplingSpec(max_tokens=6, temperature=0)
    prompts = {mb: text_ids[25 * mb : 25 * mb + 5 + 15 * mb] for mb in range(1, 4)}
    loop = _loop(client, stage)
    plan: dict[str, int | bool] = {"left": 3, "written": written}
    real = client.pipeline
    monkeypatch.setattr(loop.redis, "pipeline", lambda *a, **kw: _Pipeline(real(*a, **kw), plan))
    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    stop = _until(loop, prompts)
    error = redis.exceptions.ConnectionError if written else redis.exceptions.OutOfMemoryError
    with pytest.raises(error):
        loop.run(stop)
    assert plan["left"] == -1 and not all(_finished(client, mb) for mb in prompts)
    loop.run(stop)
    for mb, prompt in prompts.items():
        _assert_exact(client, reference, mb, prompt, sampling)
    assert _all_free(loop)


def test_a_request_whose_stream_has_tokens_continues_at_its_next_step(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A request taken again (a repair re-queued it) whose stream holds its first 5 tokens: the loop computes its
    prompt and those tokens and goes on at step 5, with the tokens an uninterrupted run delivers."""
    prompt, sampling = text_ids[10:57], SamplingSpec(max_tokens=8, temperature=0)
    tokens, finish = reference.expected(prompt, sampling)
    key = keys.tokens(7)
    for step, token in enumerate(tokens[:5]):  # as the loop publishes them (no signer: unsigned entries)
        entry = TokenStep(mb_id=7, step=step, tokens=(token,), finished=(None,))
        client.xadd(key, token_entry(None, key, entry.encode()))
    loop = _loop(client, stage)
    passes = _passes(loop)
    _queue(client, _spec(7, prompt, sampling))
    loop.run(_until(loop, [7]))
    assert _stream(client, 7) == Stream(tokens, finish)
    assert passes[:3] == [[("7", 0, 32)], [("7", 32, 20)], [("7", 52, 1)]]  # the prompt and its 5 tokens, then step 6
    assert _all_free(loop)


def test_a_task_of_a_two_row_microbatch_is_refused_with_an_error_for_every_row_and_the_others_are_served(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A request-scheduled stage serves one request per task: a task of a two-row microbatch (rows 0..2) and a
    task naming one row of a two-row spec are refused, each row of theirs finishing with ``error`` (the controller
    reads row ``r`` of an entry as ``tokens[r]``, ``finished[r]``); the one-row requests queued around them are
    exact."""
    prompt = text_ids[:30]
    _queue(client, _spec(1, prompt, GREEDY))
    _queue(client, _spec(2, prompt, GREEDY, rows=2), dst_rows=(0, 2))
    _queue(client, _spec(3, text_ids[40:70], GREEDY, rows=2), dst_rows=(0, 1))
    _queue(client, _spec(4, text_ids[80:90], GREEDY))
    loop = _loop(client, stage)
    loop.run(_until(loop, [1, 2, 3, 4]))
    for mb in (2, 3):
        assert [(e.step, e.tokens, e.finished) for e in _entries(client, mb)] == [
            (0, (-1, -1), (FinishReason.ERROR, FinishReason.ERROR))
        ], mb
    _assert_exact(client, reference, 1, prompt, GREEDY)
    _assert_exact(client, reference, 4, text_ids[80:90], GREEDY)
    assert _all_free(loop)


def test_prompt_log_probabilities_through_chunked_prefill_equal_transformers(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A 90-token prompt computed in chunks of at most 32 positions reports, in its step-0 entry, every position's
    log probability and its 3 most likely tokens: transformers' log-softmax of the whole prompt's logits (within
    1e-4). A request with the same prompt that does not ask is served beside it, exact."""
    prompt = text_ids[3:93]
    sampling = SamplingSpec(max_tokens=3, temperature=0, prompt_logprobs=3)
    loop = _loop(client, stage)
    _queue(client, _spec(1, prompt, sampling))
    _queue(client, _spec(2, prompt, GREEDY))
    loop.run(_until(loop, [1, 2]))
    _assert_exact(client, reference, 1, prompt, sampling)
    _assert_exact(client, reference, 2, prompt, GREEDY)
    (first, *rest) = _entries(client, 1)
    assert all(not e.prompt_logprobs for e in rest)
    (reported,) = first.prompt_logprobs
    assert reported is not None and len(reported) == len(prompt) and reported[0] is None
    _assert_prompt_logprobs(reported, prompt, reference, 3)
    assert _all_free(loop)


def test_a_request_dropped_by_a_recovery_and_queued_again_goes_on_from_its_stream(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A new epoch's recovery drops every request (``drop_all``: blocks back, cached prefixes kept) and the repair
    queues it again: it goes on at the step its stream reached, its prompt found in the prefix cache, and its
    stream is exact with every step written once."""
    prompt, sampling = text_ids[50:90], SamplingSpec(max_tokens=8, temperature=0)
    loop = _loop(client, stage)
    _queue(client, _spec(1, prompt, sampling))
    loop.run(_bounded(lambda: len(_entries(client, 1)) >= 3, "3 tokens delivered"))
    loop.drop_all()
    assert _all_free(loop) and loop.scheduler.book.stats().cached_free >= 2
    hits = loop.scheduler.book.stats().hits
    _queue(client, _spec(1, prompt, sampling))
    loop.run(_until(loop, [1]))
    _assert_exact(client, reference, 1, prompt, sampling)
    assert loop.scheduler.book.stats().hits - hits == 32  # its prompt's 2 full blocks
    assert _all_free(loop)


def test_prompt_log_probabilities_of_a_request_restarted_mid_prompt_cover_every_position(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A request asking for its prompt's log probabilities, dropped by a recovery after two of its prompt's chunks
    (their blocks entered the prefix cache) and queued again: nothing was delivered, so it computes its prompt
    again, every position of it (a prefix found cached would leave those positions without log probabilities),
    and its step-0 entry reports them all, transformers' within 1e-4."""
    prompt = text_ids[3:93]
    sampling = SamplingSpec(max_tokens=2, temperature=0, prompt_logprobs=1)
    loop = _loop(client, stage)
    _queue(client, _spec(1, prompt, sampling))

    def mid_prompt() -> bool:
        state = loop.scheduler.get("1")
        return state is not None and state.computed >= 32 and not state.in_flight

    loop.run(_bounded(mid_prompt, "two chunks of the prompt computed"))
    assert not _entries(client, 1)
    loop.drop_all()
    _queue(client, _spec(1, prompt, sampling))
    loop.run(_until(loop, [1]))
    _assert_exact(client, reference, 1, prompt, sampling)
    (reported,) = _entries(client, 1)[0].prompt_logprobs
    _assert_prompt_logprobs(reported, prompt, reference, 1)
    assert _all_free(loop)


def test_prefix_cache_lookups_are_counted_once_per_admission(
    client: redis.Redis, stage: Stage, text_ids: list[int]
) -> None:
    """The prefix cache's query and hit tokens (the worker's metrics) count each admission's lookup once: a
    request waiting at the head of the queue for room is not counted again at every pass it waits."""
    prompts, sampling = _crowded(text_ids)
    loop = _loop(client, stage, blocks=5)
    admitted: list[int] = []  # the hit tokens of each admission (a waiting request moved to running)
    schedule = loop.scheduler.schedule

    def spy():
        waiting = list(loop.scheduler.waiting)
        step = schedule()
        admitted.extend(r.cached_tokens for r in waiting if r in loop.scheduler.running)
        return step

    loop.scheduler.schedule = spy  # type: ignore[method-assign]
    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    loop.run(_until(loop, prompts))
    stats = loop.scheduler.book.stats()
    assert len(admitted) > len(prompts)  # one was preempted and admitted again
    assert (stats.queries, stats.hits) == (30 * len(admitted), sum(admitted))


def test_a_request_whose_answer_reaches_the_end_of_its_context_ends_with_length(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A request asking for more tokens than its context holds (the controller caps ``max_len`` at the model's
    context) delivers what fits, as a row does (``RowTracker``: the token after position ``max_len - 1``, whose KV
    is never written, is the last), and its stream ends with ``length``: the controller waits for that finish."""
    prompt, sampling = text_ids[60:80], SamplingSpec(max_tokens=10, temperature=0)
    spec = _spec(1, prompt, sampling).model_copy(update={"max_len": 25})
    loop = _loop(client, stage)
    _queue(client, spec)
    _queue(client, _spec(2, text_ids[:12], GREEDY))  # served after it: the loop went on
    loop.run(_until(loop, [1, 2]))
    tokens, _ = reference.expected(prompt, sampling)
    assert _stream(client, 1) == Stream(tokens[: 25 - 20 + 1], FinishReason.LENGTH)
    _assert_exact(client, reference, 2, text_ids[:12], GREEDY)
    assert _all_free(loop)


def test_a_request_longer_than_the_pool_fails_alone(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int]
) -> None:
    """A request whose prompt and longest answer need more blocks than the whole pool has ends with ``error`` at
    step 0; the others are served."""
    loop = _loop(client, stage, blocks=5)
    _queue(client, _spec(1, text_ids[:70], SamplingSpec(max_tokens=20, temperature=0)))
    _queue(client, _spec(2, text_ids[:12], GREEDY))
    loop.run(_until(loop, [1, 2]))
    assert [(e.step, e.tokens, e.finished) for e in _entries(client, 1)] == [(0, (-1,), (FinishReason.ERROR,))]
    _assert_exact(client, reference, 2, text_ids[:12], GREEDY)
    assert _all_free(loop)


def test_a_task_claimed_when_redis_fails_is_served_by_the_next_run(
    client: redis.Redis, stage: Stage, reference: Reference, text_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a claimed task's spec fails (Redis went away for a moment): ``run`` raises, and the task, acknowledged
    on the stream already, is not lost: the next ``run`` serves its request."""
    prompt = text_ids[5:25]
    loop = _loop(client, stage)
    real, failures = client.get, [keys.microbatch(1)]

    def get(key, *args, **kwargs):
        if failures and key == failures[0]:
            failures.pop()
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return real(key, *args, **kwargs)

    monkeypatch.setattr(loop.redis, "get", get)
    _queue(client, _spec(1, prompt, GREEDY))
    stop = _until(loop, [1])
    with pytest.raises(redis.exceptions.ConnectionError):
        loop.run(stop)
    loop.run(stop)
    _assert_exact(client, reference, 1, prompt, GREEDY)
    assert _all_free(loop)


def test_a_sampled_request_restarted_from_its_stream_draws_what_it_would_have_drawn(
    client: redis.Redis, stage: Stage, text_ids: list[int]
) -> None:
    """A seeded request with temperature and penalties, dropped after 3 tokens and queued again, goes on with the
    tokens an uninterrupted run of it draws (each draw a function of its seed and step; the penalties see the
    tokens its stream holds)."""
    prompt = text_ids[110:140]
    sampling = SamplingSpec(max_tokens=8, temperature=0.9, seed=11, repetition_penalty=1.3, frequency_penalty=0.5)
    loop = _loop(client, stage)
    _queue(client, _spec(1, prompt, sampling))
    loop.run(_until(loop, [1]))
    _queue(client, _spec(2, prompt, sampling))
    loop.run(_bounded(lambda: len(_entries(client, 2)) >= 3, "3 tokens delivered"))
    loop.drop_all()
    _queue(client, _spec(2, prompt, sampling))
    loop.run(_until(loop, [2]))
    assert _stream(client, 2) == _stream(client, 1) and len(_stream(client, 1).tokens) == 8
    assert _all_free(loop)


def test_a_sliding_window_stage_gives_back_blocks_out_of_the_window_and_streams_transformers_tokens(
    client: redis.Redis, tmp_path: Path
) -> None:
    """A tiny Mistral with a window of 32 positions in a pool of 8 blocks (128 positions): a 300-position request
    (an 80-token prompt in chunks, 220 tokens) beside one sharing its first 64 prompt tokens (a prefix hit on blocks
    the first already gave back), each holding at most the window's and a pass's blocks; both streams are
    transformers' greedy ones."""
    folder = build_checkpoint(
        "mistral", tmp_path / "mistral", overrides={"sliding_window": 32, "max_position_embeddings": 512}
    )
    stage = Pipeline(folder, 1, "cpu", "float32").stages[0]
    if not stage.paged_attention:
        pytest.skip("the request loop needs the native paged attention kernels (see request_stage.schedules_requests)")
    assert stage.kv_window == 32
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(3, 380, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    cases = {1: (ids[:80], 220), 2: (ids[:64] + ids[80:90], 40)}
    loop = _loop(client, stage, blocks=8, tokens=32)
    held: dict[str, int] = {}
    run = loop.executor.run

    def recording(step: ScheduledPass, every: Collection[int] = ()) -> PassLogits:
        for s in step.slices:
            live = [b for b in s.table if b != FREED]
            held[s.request.request_id] = max(held.get(s.request.request_id, 0), len(live))
        return run(step, every)

    loop.executor.run = recording  # type: ignore[method-assign]
    for mb, (prompt, n) in cases.items():
        _queue(client, _spec(mb, prompt, SamplingSpec(max_tokens=n, temperature=0, ignore_eos=True)))
    loop.run(_until(loop, cases))
    for mb, (prompt, n) in cases.items():
        expected = list(prompt)
        with torch.inference_mode():
            for _ in range(n):
                expected.append(int(model(torch.tensor([expected])).logits[0, -1].argmax()))
        assert _stream(client, mb) == Stream(expected[len(prompt) :], FinishReason.LENGTH), f"microbatch {mb}"
    assert loop.scheduler.book.stats().hits == 64  # the second request's first four blocks
    assert max(held.values()) <= most_blocks(300, BLOCK, 32, 32) == 5
    assert _all_free(loop)
