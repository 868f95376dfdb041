"""A read-only picture of what the controller knows right now, for the status page (``/dashboard``).

:meth:`PipelineBackend.overview <dejavu_controller.pipeline_backend.PipelineBackend.overview>` builds
one from its registry view, scheduler and repair task. Nothing here does I/O or changes what it reads:
an :class:`Overview` is a set of frozen values, safe to serialize after the event loop moved on.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dejavu_common.messages import Topology
from dejavu_controller.registry import WorkerView
from dejavu_controller.repair import RepairTimings
from dejavu_controller.request import Request

#: In-flight requests an overview lists (oldest first); it counts all of them.
MAX_REQUESTS_SHOWN = 100


@dataclass(frozen=True)
class RequestView:
    """One request in flight: where it is and how far it got."""

    request_id: str
    status: str  # a RequestStatus value: queued, scheduled (in the prompt pipeline) or decoding
    prompt_tokens: int
    generated: int
    max_tokens: int  # its generation budget (what the context leaves where the client set none)
    microbatch: int | None
    age_s: float  # since admission

    @classmethod
    def of(cls, request: Request, now: float) -> RequestView:
        return cls(
            request_id=request.request_id,
            status=request.status.value,
            prompt_tokens=len(request.prompt_ids),
            generated=len(request.output_ids),
            max_tokens=request.sampling.max_tokens,
            microbatch=request.mb_id,
            age_s=max(0.0, now - request.arrival),
        )


class RepairState(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # an error half way: its microbatches were failed to their clients
    SUPERSEDED = "superseded"  # cancelled: a newer failure started a newer repair (or the controller stops)


@dataclass(frozen=True)
class RepairView:
    """The newest repair of the pipelines: what it covers, how far it got, how long it took."""

    epoch: int  # the topology epoch it repairs to
    replaced: Mapping[int, str]  # token stage -> its new holder
    resumable: tuple[int, ...]  # microbatches that resume from the surviving caches and replicas
    rerun: tuple[int, ...]  # microbatches still in the prompt phase, which re-run their prompts
    dropped: tuple[int, ...]  # microbatches failed to their clients (in flight for too many repairs)
    state: RepairState
    seconds: float | None  # running: since the failure's detection; done: detection to resumption
    phases: Mapping[str, float]  # phase -> seconds from detection to its end (those ended so far)

    @classmethod
    def of(
        cls,
        epoch: int,
        replaced: Mapping[int, str],
        resumable: Iterable[int],
        rerun: Iterable[int],
        dropped: Iterable[int],
        task: asyncio.Task,
        timings: RepairTimings | None,
        now: float,
    ) -> RepairView:
        """The view of the repair ``task`` started for ``epoch``; ``timings`` are the repair's phase timings
        (:attr:`Repair.current <dejavu_controller.repair.Repair.current>`), ignored if they belong to
        another run (a task cancelled before it began keeps the previous run's there)."""
        state = _task_state(task)
        detected_at = timings.detected_at if timings is not None else None
        phases = dict(timings.phases) if timings is not None else {}
        if state is RepairState.RUNNING:
            seconds = now - detected_at if detected_at is not None else None
        else:
            seconds = phases.get("resumed")
        return cls(
            epoch=epoch,
            replaced=dict(replaced),
            resumable=tuple(resumable),
            rerun=tuple(rerun),
            dropped=tuple(dropped),
            state=state,
            seconds=seconds,
            phases=phases,
        )


def _task_state(task: asyncio.Task) -> RepairState:
    if not task.done():
        return RepairState.RUNNING
    if task.cancelled():
        return RepairState.SUPERSEDED
    return RepairState.FAILED if task.exception() is not None else RepairState.DONE


@dataclass(frozen=True)
class Overview:
    """What the controller knows of its deployment: its role, the pipelines, the workers as of its last
    registry poll, the requests in flight, and the newest repair."""

    leader: bool  # holds the leader lease (a standby serves nothing)
    ready: bool
    topology: Topology | None
    workers: Mapping[str, WorkerView]
    requests: tuple[RequestView, ...]  # at most MAX_REQUESTS_SHOWN, oldest first
    requests_in_flight: int  # all of them, shown or not
    repair: RepairView | None


def requests_in_flight(waiting: Iterable[Request], dispatched: Iterable[Request]) -> list[Request]:
    """Requests not yet ended, queued or dispatched, oldest first."""
    live = [r for r in (*waiting, *dispatched) if not r.done]
    return sorted(live, key=lambda r: r.arrival)


def request_views(requests: list[Request], now: float | None = None) -> tuple[RequestView, ...]:
    """Views of the first :data:`MAX_REQUESTS_SHOWN` of ``requests``."""
    now = time.monotonic() if now is None else now
    return tuple(RequestView.of(r, now) for r in requests[:MAX_REQUESTS_SHOWN])


@runtime_checkable
class Observable(Protocol):
    """A backend that can tell the status page more than :class:`~dejavu_controller.backend.BackendStats`."""

    def overview(self) -> Overview: ...
