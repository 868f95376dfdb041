"""The status page's snapshot: one JSON document of what the controller knows, and a log of what changed.

:class:`Feed` builds a snapshot from the backend (its :class:`~dejavu_controller.backend.BackendStats`,
and its :class:`~dejavu_controller.overview.Overview` where it has one) and the gateway's metrics, at most
once per :data:`MIN_AGE_S` however many pages watch, and compares each with the one before: a new topology
epoch (who took which stage), a lease lost or back, a worker's state, a repair starting and ending, the
pipeline's readiness. Those changes are its event log, newest last, the last :data:`EVENTS_KEPT` of them;
changes are seen while some page (or ``/dashboard/snapshot`` caller) watches, and each snapshot says since
when the feed has watched. Everything here runs on the event loop and does no I/O.

The snapshot's shape (``docs/api.md``, *Status page*)::

    {"time": <unix s>, "watching_since": <unix s>, "model": str,
     "controller": {"leader", "ready", "queue_depth", "in_flight", "stalled_s", "counters": {...}},
     "topology": null | {"epoch", "mode", "n_layers", "prompt": [stage], "token": [stage]},
     "workers": [{"id", "role", "spare", "stage", "alive", "state", "epoch", "seen", "kv_bytes",
                  "kv_microbatches", "host", "pid"}],
     "requests": {"in_flight": int, "shown": [{"id", "status", "prompt_tokens", "generated", "max_tokens",
                                              "microbatch", "age_s"}]},
     "repair": null | {"epoch", "state", "replaced", "resumable", "rerun", "dropped", "seconds", "phases"},
     "events": [{"time", "kind", "message"}],
     "actions": {"enabled": bool, "reason": str | null, "max_pause_s": float}}

where a stage is ``{"stage", "worker", "layers": [first, end)}``. Without an overview (a backend that has
none) ``topology`` and ``repair`` are null, ``workers`` lists the stats' worker states alone and
``requests.shown`` is empty.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dejavu_common.messages import StageAssignment, Topology
from dejavu_controller.backend import BackendStats
from dejavu_controller.overview import Observable, Overview, RepairState, RepairView
from dejavu_controller.registry import WorkerView

from .metrics import GatewayMetrics, KVStream, Outcome
from .state import Gateway

#: A snapshot younger than this is served again instead of built anew (pages ask about once a second).
MIN_AGE_S = 0.5
#: Changes the event log keeps.
EVENTS_KEPT = 200


@dataclass(frozen=True)
class Actions:
    """Whether the page may send admin actions, and why not."""

    enabled: bool
    reason: str | None
    max_pause_s: float


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds
    kind: str  # topology, lease, state, repair, ready, action
    message: str


@dataclass(frozen=True)
class Summary:
    """What the event log compares between two snapshots."""

    epoch: int | None
    holders: Mapping[str, str]  # "prompt 0" / "token 1" -> worker id
    alive: Mapping[str, bool]
    states: Mapping[str, str]
    ready: bool
    repair: tuple[int, RepairState] | None

    @classmethod
    def of(cls, ready: bool, overview: Overview | None, stats: BackendStats) -> Summary:
        if overview is None:
            states = dict(stats.workers)
            return cls(None, {}, {}, states, ready, None)
        topology = overview.topology
        holders = {} if topology is None else {name: a.worker_id for name, a in _stages(topology)}
        repair = None if overview.repair is None else (overview.repair.epoch, overview.repair.state)
        return cls(
            epoch=None if topology is None else topology.epoch,
            holders=holders,
            alive={w: v.alive for w, v in overview.workers.items()},
            states={w: v.state.value for w, v in overview.workers.items()},
            ready=ready,
            repair=repair,
        )


def changes(before: Summary, after: Summary, repair: RepairView | None) -> list[tuple[str, str]]:
    """``(kind, message)`` for each change from ``before`` to ``after`` (``repair``: ``after``'s repair)."""
    out: list[tuple[str, str]] = []
    if after.epoch != before.epoch and after.epoch is not None:
        moved = [
            f"{stage} {before.holders.get(stage, '-')} -> {worker}"
            for stage, worker in after.holders.items()
            if before.holders.get(stage) != worker
        ]
        detail = f": {', '.join(moved)}" if moved and before.epoch is not None else ""
        out.append(("topology", f"topology epoch {after.epoch} published{detail}"))
    for worker, alive in after.alive.items():
        if worker not in before.alive and worker not in before.states:
            out.append(("lease", f"{worker} registered"))
        elif before.alive.get(worker, alive) != alive:
            out.append(("lease", f"{worker}'s lease {'is renewed again' if alive else 'expired'}"))
    for worker in before.states.keys() - after.states.keys():
        out.append(("lease", f"{worker} left the registry"))
    for worker, state in after.states.items():
        if worker in before.states and before.states[worker] != state:
            out.append(("state", f"{worker}: {before.states[worker]} -> {state}"))
    if after.repair != before.repair and after.repair is not None and repair is not None:
        out.append(("repair", _repair_message(repair)))
    if after.ready != before.ready:
        out.append(("ready", "the pipelines serve" if after.ready else "the pipelines do not serve"))
    return out


def _repair_message(repair: RepairView) -> str:
    stages = ", ".join(f"token {s} -> {w}" for s, w in sorted(repair.replaced.items())) or "no token stage"
    if repair.state is RepairState.RUNNING:
        return (
            f"repair to epoch {repair.epoch} started ({stages}): resuming microbatches {list(repair.resumable)}, "
            f"re-running {list(repair.rerun)}"
        )
    took = f" in {repair.seconds:.2f} s" if repair.seconds is not None else ""
    return f"repair to epoch {repair.epoch} {repair.state.value}{took} ({stages})"


class Feed:
    """Snapshots of one gateway, shared by every page that watches it, and the log of their changes."""

    def __init__(
        self, actions: Callable[[], Actions], clock: Callable[[], float] = time.time, min_age_s: float = MIN_AGE_S
    ) -> None:
        self._actions = actions
        self._clock = clock
        self.min_age_s = min_age_s
        self._events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._summary: Summary | None = None
        self._snapshot: dict[str, Any] | None = None
        self._built_at = float("-inf")  # monotonic
        self.watching_since: float | None = None

    def record(self, kind: str, message: str) -> None:
        """Add an event of the page's own (an admin action sent)."""
        self._events.append(Event(self._clock(), kind, message))
        self._snapshot = None  # the next snapshot shows it

    def snapshot(self, gateway: Gateway) -> dict[str, Any]:
        """The current snapshot (see the module docstring), built anew at most every ``min_age_s``."""
        now = time.monotonic()
        if self._snapshot is not None and now - self._built_at < self.min_age_s:
            return self._snapshot
        backend = gateway.backend
        stats = backend.stats()
        ready = backend.is_ready()
        overview = backend.overview() if isinstance(backend, Observable) else None
        summary = Summary.of(ready, overview, stats)
        wall = self._clock()
        if self._summary is None:
            self.watching_since = wall
        else:
            for kind, message in changes(self._summary, summary, overview.repair if overview else None):
                self._events.append(Event(wall, kind, message))
        self._summary = summary
        self._snapshot = build(gateway, stats, ready, overview, list(self._events), self._actions(), wall)
        self._snapshot["watching_since"] = self.watching_since
        self._built_at = now
        return self._snapshot


def build(
    gateway: Gateway,
    stats: BackendStats,
    ready: bool,
    overview: Overview | None,
    events: list[Event],
    actions: Actions,
    now: float,
) -> dict[str, Any]:
    """The snapshot document (see the module docstring) from what was read."""
    topology = overview.topology if overview is not None else None
    return {
        "time": now,
        "model": gateway.model_name,
        "controller": {
            "leader": overview.leader if overview is not None else True,
            "ready": ready,
            "queue_depth": stats.queue_depth,
            "in_flight": in_flight(gateway.metrics),
            "stalled_s": stats.stalled_s,
            "counters": counters(gateway.metrics),
        },
        "topology": None if topology is None else _topology(topology),
        "workers": _workers(overview, stats, topology),
        "requests": _requests(overview),
        "repair": None if overview is None or overview.repair is None else _repair(overview.repair),
        "events": [{"time": e.time, "kind": e.kind, "message": e.message} for e in events],
        "actions": {"enabled": actions.enabled, "reason": actions.reason, "max_pause_s": actions.max_pause_s},
    }


def in_flight(metrics: GatewayMetrics) -> int:
    """Requests the gateway has in flight, every API key together (``dejavu_key_in_flight``)."""
    total = 0.0
    for family in metrics.registry.collect():
        if family.name == "dejavu_key_in_flight":
            total += sum(sample.value for sample in family.samples)
    return int(total)


def counters(metrics: GatewayMetrics) -> dict[str, Any]:
    """The gateway's cumulative counters, as ``/metrics`` has them: requests by outcome, tokens, KV bytes."""
    registry = metrics.registry

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return registry.get_sample_value(name, labels or {}) or 0.0

    return {
        "requests": {o.value: int(value("dejavu_requests_total", {"outcome": o.value})) for o in Outcome},
        "prompt_tokens": int(value("dejavu_prompt_tokens_total")),
        "generated_tokens": int(value("dejavu_generated_tokens_total")),
        "kv_bytes_streamed": {
            k.value: int(value("dejavu_kv_bytes_streamed_total", {"purpose": k.value})) for k in KVStream
        },
    }


def _stages(topology: Topology) -> list[tuple[str, StageAssignment]]:
    return [(f"prompt {a.stage}", a) for a in topology.prompt_stages] + [
        (f"token {a.stage}", a) for a in topology.token_stages
    ]


def _stage(a: StageAssignment) -> dict[str, Any]:
    return {"stage": a.stage, "worker": a.worker_id, "layers": list(a.layers)}


def _topology(topology: Topology) -> dict[str, Any]:
    return {
        "epoch": topology.epoch,
        "mode": topology.mode,
        "n_layers": topology.n_layers,
        "prompt": [_stage(a) for a in topology.prompt_stages],
        "token": [_stage(a) for a in topology.token_stages],
    }


def _workers(overview: Overview | None, stats: BackendStats, topology: Topology | None) -> list[dict[str, Any]]:
    if overview is None:
        return [{"id": w, "state": state} for w, state in sorted(stats.workers.items())]
    where = {} if topology is None else {a.worker_id: name for name, a in _stages(topology)}
    return [_worker(w, v, where.get(w)) for w, v in sorted(overview.workers.items())]


def _worker(worker_id: str, view: WorkerView, stage: str | None) -> dict[str, Any]:
    return {
        "id": worker_id,
        "role": view.info.role.value,
        "spare": view.info.spare,
        "stage": stage,
        "alive": view.alive,
        "state": view.state.value,
        "epoch": view.epoch,
        "seen": view.seen,
        "kv_bytes": view.kv_bytes,
        "kv_microbatches": view.kv_microbatches,
        "host": view.info.host,
        "pid": view.info.pid,
    }


def _requests(overview: Overview | None) -> dict[str, Any]:
    if overview is None:
        return {"in_flight": None, "shown": []}
    shown = [
        {
            "id": r.request_id,
            "status": r.status,
            "prompt_tokens": r.prompt_tokens,
            "generated": r.generated,
            "max_tokens": r.max_tokens,
            "microbatch": r.microbatch,
            "age_s": round(r.age_s, 3),
        }
        for r in overview.requests
    ]
    return {"in_flight": overview.requests_in_flight, "shown": shown}


def _repair(repair: RepairView) -> dict[str, Any]:
    return {
        "epoch": repair.epoch,
        "state": repair.state.value,
        "replaced": {str(stage): worker for stage, worker in sorted(repair.replaced.items())},
        "resumable": list(repair.resumable),
        "rerun": list(repair.rerun),
        "dropped": list(repair.dropped),
        "seconds": repair.seconds,
        "phases": dict(repair.phases),
    }
