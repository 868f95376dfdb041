"""The controller's side of failure recovery (the paper's four steps), as an asyncio task.

When a stage holder is lost the control loop builds a new topology (a spare or the restarted
process takes the stage; the epoch bump fences the old worker), and:

1. :meth:`Repair.announce` writes the :class:`RecoveryOrder` naming the replaced token stages and the
   microbatches to resume, *before* the topology is published: a worker that sees the new epoch always
   finds its order (without one it would take the epoch for a fresh pipeline and drop its caches);
   then the topology is published and :meth:`Repair.run` drives the rest:
2. the token stages exchange caches (successor -> replacement: the replica; predecessor ->
   replacement: its own cache) and report progress; the replacement reports when it is restored (or
   that it could not be: then, as when the reports do not all come in time, every prompt re-runs);
3. it computes each microbatch's resume step from progress and replication watermarks
   (:func:`plan_resume`) and publishes the :class:`ResumePoint`;
4. microbatches that cannot resume re-run their prompts.

Each phase is timed and logged; the durations feed ``dejavu_recovery_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from redis.exceptions import ResponseError

from dejavu_common import keys
from dejavu_common.messages import RecoveryOrder, ResumePoint, StageProgress, Topology
from dejavu_common.redis_client import data
from dejavu_common.settings import Replication, Settings
from dejavu_common.signing import unseal, verify_watermark
from dejavu_controller.aio import cancellation_point
from dejavu_controller.api.metrics import RuntimeMetrics
from dejavu_controller.recovery import plan_resume

log = logging.getLogger("dejavu.controller.repair")


def _progress(
    raw: bytes, epoch: int, stage: int, topology: Topology, writers: Mapping[str, tuple[Ed25519PublicKey, ...]]
) -> StageProgress | None:
    """A survivor's progress report (its microbatch -> step map, its requests' tables), or None (logged) for one
    that is not sealed by the worker the topology names for ``stage`` under its key (``dejavu_common.signing``: any
    worker's Redis user may write the key), does not decode, or is not that stage's report at ``epoch``."""
    holder = next((a.worker_id for a in topology.token_stages if a.stage == stage), None)
    accepted = {holder: writers.get(holder, ())} if holder is not None else {}
    try:
        _, payload = unseal(keys.progress(epoch, stage), raw, accepted)
        report = StageProgress.decode(payload)
    except ValueError as exc:  # UnverifiedEntry included
        log.error("refused the progress report of stage %d at epoch %d: %s", stage, epoch, exc)
        return None
    if (report.epoch, report.stage, report.worker_id) != (epoch, stage, holder):
        log.error(
            "progress report at %s claims epoch %d, stage %d, worker %s; the topology names %s",
            keys.progress(epoch, stage),
            report.epoch,
            report.stage,
            report.worker_id,
            holder,
        )
        return None
    return report


@dataclass
class RepairTimings:
    """Seconds of each recovery phase, from the moment the failure was detected."""

    detected_at: float
    phases: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.monotonic() - self.detected_at


class Repair:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.last: RepairTimings | None = None  # of the newest run that finished
        self.current: RepairTimings | None = None  # of the newest run, its phases filled in as they end
        # The workers whose signed reports count, with their keys (the backend's ``EntryWriters``).
        self.writers: Mapping[str, tuple[Ed25519PublicKey, ...]] = {}

    async def _watermarks(self, stage: int, topology: Topology) -> dict[int, int]:
        """``stage``'s replication watermarks (microbatch -> last replicated step), each only where the
        replica's holder (the topology's holder of the next stage) signed it (``dejavu_common.signing``: any
        worker's Redis user may write the hash). One that is unsigned, signed by another worker or does not
        parse is skipped and logged: that microbatch counts as unreplicated (it resumes from an older step
        or re-runs); a key of the wrong type counts as no watermarks."""
        key, depth = keys.watermark(stage), len(topology.token_stages)
        holder = next((a.worker_id for a in topology.token_stages if a.stage == (stage + 1) % depth), None)
        accepted = {holder: self.writers.get(holder, ())} if holder is not None else {}
        try:
            marks = await self.redis.hgetall(key)
            signatures = await self.redis.hgetall(keys.watermark_signatures(stage))
        except ResponseError as exc:
            log.error("ignoring the watermarks of stage %d: %s", stage, exc)
            return {}
        out: dict[int, int] = {}
        for mb, step in marks.items():
            try:
                signature = signatures.get(mb)
                sealed = None if signature is None else data(signature)
                out[int(mb)] = verify_watermark(key, data(mb), data(step), sealed, accepted)
            except ValueError as exc:  # UnverifiedEntry included
                log.error("ignoring the watermark of stage %d for microbatch %r (%r): %s", stage, mb, step, exc)
        return out

    async def announce(self, epoch: int, replaced: dict[int, str], resumable: list[int]) -> None:
        """Step 1: the recovery order of ``epoch``. Written before that epoch's topology is published."""
        order = RecoveryOrder(epoch=epoch, replaced=replaced, microbatches=tuple(resumable))
        await self.redis.set(keys.RECOVERY, order.encode())

    async def run(
        self,
        topology: Topology,
        replaced: dict[int, str],
        resumable: list[int],
        not_started: list[int],
        redispatch: Callable[[list[int]], Awaitable[None]],
        detected_at: float,
        metrics: RuntimeMetrics | None = None,
        dropped: list[int] | None = None,
    ) -> ResumePoint:
        """Drive recovery at ``topology.epoch`` (its order announced already); returns the resume point.

        ``resumable``: microbatches the token pipeline had admitted (their first tokens exist);
        ``not_started``: active microbatches still in the prompt phase, which re-run their prompts;
        ``dropped``: microbatches the controller failed, which every worker frees.
        """
        timings = self.current = RepairTimings(detected_at)
        epoch = topology.epoch
        timings.mark("replacement_assigned")
        log.warning(
            "recovery at epoch %d: replaced token stages %s, resuming microbatches %s", epoch, replaced, resumable
        )
        depth = len(topology.token_stages)
        survivors = [a.stage for a in topology.token_stages if a.stage not in replaced]
        deadline = time.monotonic() + self.settings.transport.deadline_s * 3
        progress: dict[int, dict[int, int]] = {}
        tables: dict[int, tuple[int, ...]] = {}  # stage 1's request tables (a replaced stage 0 rebuilds its book)
        restored: dict[int, bytes | str] = {}
        malformed: set[int] = set()  # survivors whose progress report does not parse
        while time.monotonic() < deadline:
            cancellation_point()
            for s in survivors:
                if s not in progress and s not in malformed:
                    raw = await self.redis.get(keys.progress(epoch, s))
                    if raw is not None:
                        report = _progress(data(raw), epoch, s, topology, self.writers)
                        if report is None:
                            malformed.add(s)
                        else:
                            progress[s] = report.done
                            if s == 1:
                                tables = report.tables
            if malformed:
                log.error(
                    "recovery at epoch %d: stages %s reported malformed progress: re-running every prompt",
                    epoch,
                    sorted(malformed),
                )
                progress = {}
                break
            for s in replaced:
                if s not in restored and (outcome := await self.redis.get(keys.restored(epoch, s))) is not None:
                    restored[s] = outcome
            if keys.RESTORE_FAILED in restored.values():
                log.error(
                    "recovery at epoch %d: stages %s could not restore their caches: re-running every prompt",
                    epoch,
                    sorted(s for s, outcome in restored.items() if outcome == keys.RESTORE_FAILED),
                )
                progress = {}
                break
            if len(progress) == len(survivors) and restored.keys() == set(replaced):
                break
            await asyncio.sleep(0.02)
        else:
            log.error(
                "recovery at epoch %d timed out (progress from %s, restored %s): re-running every prompt",
                epoch,
                sorted(progress),
                sorted(restored),
            )
            progress = {}
        cancellation_point()  # a superseded or shut-down repair publishes nothing
        timings.mark("cache_restored")
        watermarks = {}
        for s in replaced:
            watermarks[s] = await self._watermarks(s, topology)
        replication = self.settings.recovery.replication is not Replication.OFF
        plan = plan_resume(epoch, depth, resumable, set(replaced), progress, watermarks, replication)
        plan = plan.model_copy(
            update={
                "rerun": tuple(sorted({*plan.rerun, *not_started})),
                "dropped": tuple(sorted(dropped or ())),
                "tables": {mb: t for mb, t in tables.items() if mb in plan.resume} if 0 in replaced else {},
            }
        )
        cancellation_point()
        await self.redis.set(keys.RESUME, plan.encode())
        if plan.rerun:
            await redispatch(list(plan.rerun))
        timings.mark("resumed")
        self.last = timings
        if metrics is not None:
            for phase, seconds in timings.phases.items():
                metrics.observe_recovery(phase, seconds)
        log.warning(
            "recovery at epoch %d done: resume %s, re-run prompts of %s; phases %s",
            epoch,
            plan.resume,
            list(plan.rerun),
            {k: round(v, 3) for k, v in timings.phases.items()},
        )
        return plan
