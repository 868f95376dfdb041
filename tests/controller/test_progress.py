"""The controller's progress watchdog: dispatched requests that get no token and no error for longer than
the stall limit, while the pipeline is up, make ``/ready`` answer 503 (code ``stalled``) and show in the
metrics, until entries flow again. Idle, pipeline-less and repairing controllers never count as stalled.
Times are given explicitly: nothing here waits."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from dejavu_common.messages import TokenStep
from dejavu_common.settings import Settings
from dejavu_controller.backend import BackendStats, GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend
from dejavu_controller.progress import ProgressWatchdog, stall_limit_s
from tests.controller.entry_writer import publish, stage_holder

from .conftest import ScriptedBackend
from .test_api_errors import assert_error


def test_work_awaited_without_progress_past_the_limit_is_a_stall_until_an_entry_arrives() -> None:
    w = ProgressWatchdog(stall_after_s=60.0)
    assert w.observe(100.0, awaiting=True, pipeline_up=True) is None  # the wait starts here
    assert w.observe(160.0, awaiting=True, pipeline_up=True) is None  # at the limit: not past it
    assert w.observe(161.0, awaiting=True, pipeline_up=True) == 61.0
    assert w.stalled_s == 61.0
    w.progressed(170.0)  # a token (or an error) for some dispatched request
    assert w.observe(171.0, awaiting=True, pipeline_up=True) is None and w.stalled_s is None
    assert w.observe(231.0, awaiting=True, pipeline_up=True) == 61.0  # and it can stall again


def test_idle_no_pipeline_and_repairs_never_count_as_stalled() -> None:
    w = ProgressWatchdog(stall_after_s=60.0)
    w.progressed(0.0)  # an entry while nothing is awaited starts nothing
    assert w.observe(500.0, awaiting=False, pipeline_up=True) is None  # idle
    assert w.observe(1000.0, awaiting=True, pipeline_up=False) is None  # no pipeline, or a repair runs
    assert w.observe(1050.0, awaiting=True, pipeline_up=True) is None  # the wait starts when both hold...
    assert w.observe(1111.0, awaiting=True, pipeline_up=True) == 61.0
    assert w.observe(1112.0, awaiting=True, pipeline_up=False) is None  # ...and a repair ends the stall
    assert w.observe(1113.0, awaiting=True, pipeline_up=True) is None  # the wait starts over after it


def test_the_limit_defaults_to_twelve_transport_deadlines_and_must_be_positive() -> None:
    assert stall_limit_s(None, 10.0) == 120.0
    assert stall_limit_s(300.0, 10.0) == 300.0
    assert Settings().controller.progress_stall_s is None
    with pytest.raises(ValueError):
        ProgressWatchdog(0.0)


def test_ready_answers_503_stalled_while_the_backend_reports_a_stall(
    client: TestClient, backend: ScriptedBackend, monkeypatch
) -> None:
    assert client.get("/ready").json() == {"status": "ready"}
    monkeypatch.setattr(backend, "stats", lambda: BackendStats(stalled_s=130.4))
    error = assert_error(client.get("/ready"), 503, code="stalled")
    assert "130 s" in error["message"]
    assert "dejavu_progress_stalled_seconds 130.4" in client.get("/metrics").text
    assert client.get("/health").json() == {"status": "ok"}  # liveness is not readiness: no restart
    backend.ready = False
    assert_error(client.get("/ready"), 503, code="not_ready")  # no pipeline says so first
    monkeypatch.setattr(backend, "stats", lambda: BackendStats())
    backend.ready = True
    assert client.get("/ready").json() == {"status": "ready"}


def test_the_backend_reports_dispatched_work_that_gets_no_entry_and_clears_when_one_comes(redis_url: str) -> None:
    """A real backend on a real Redis: a dispatched microbatch whose stream stays empty past the limit is a
    stall (its request waits for a worker that forgot it); the first entry relayed ends it."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        base = Settings()
        settings = base.model_copy(update={"controller": base.controller.model_copy(update={"progress_stall_s": 30.0})})
        backend = PipelineBackend(settings, r, n_layers=6)
        backend._ready = True
        events = await backend.generate(GenerationRequest("r", (1, 2, 3), SamplingSpec(max_tokens=4, temperature=0)))
        now = time.monotonic()
        assert backend._watch_progress(now) is None  # nothing dispatched yet
        [mb] = backend.scheduler.form(now=1e9)
        await backend._dispatch([mb])
        assert backend._watch_progress(now) is None  # the wait for its first entry starts
        assert backend._watch_progress(now + 31.0) == pytest.approx(31.0)
        assert backend.stats().stalled_s == pytest.approx(31.0)
        step = TokenStep(mb_id=mb.spec.mb_id, step=0, tokens=(5,), finished=(None,))
        await publish(r, await stage_holder(r, backend), step)
        await backend._relay_once()
        assert backend._watch_progress(time.monotonic()) is None
        assert backend.stats().stalled_s is None
        await events.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
