"""Worker registry: who is alive (leases in Redis) and which stage each worker holds.

Workers register themselves (``keys.worker``) and renew a lease (``keys.worker_lease``, a key with
a TTL). The controller polls them, assembles the prompt and token pipelines, and publishes a
:class:`Topology` with a fresh epoch whenever the membership of a pipeline changes; a worker that
is not in the newest topology is fenced.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from dejavu_common import keys
from dejavu_common.messages import KVHeld, StageAssignment, Topology, WorkerInfo, WorkerRole, WorkerState
from dejavu_common.partition import split_layers
from dejavu_common.redis_client import text
from dejavu_common.settings import ControllerSettings, Mode

log = logging.getLogger("dejavu.controller.registry")

_LEAVING = frozenset({WorkerState.STOPPED, WorkerState.DRAINING})  # never given a stage
_SERVES = frozenset({WorkerState.SERVING, WorkerState.DRAINING})  # a draining holder serves until handed over


@dataclass(frozen=True)
class WorkerView:
    info: WorkerInfo
    alive: bool
    state: WorkerState
    epoch: int  # the epoch the worker last reported its state at
    kv_bytes: int = 0  # KV the worker holds (token workers: caches and replicas), as of its last heartbeat
    kv_microbatches: int = 0
    seen: int = 0  # the newest topology epoch the worker has accepted (it accepts only newer ones)


_MAX_EPOCH = 1 << 53  # far beyond any real epoch (one per topology change), and exact as a JSON number


def _epoch(raw: bytes) -> int:
    """An epoch a worker reported; ``ValueError`` unless it is an integer in [0, ``_MAX_EPOCH``] (a forged
    huge one would push every later topology's epoch out of range)."""
    value = int(raw)
    if not 0 <= value <= _MAX_EPOCH:
        raise ValueError(f"epoch {value} out of range")
    return value


class Registry:
    def __init__(self, redis: aioredis.Redis, settings: ControllerSettings, n_layers: int) -> None:
        self.redis = redis
        self.settings = settings
        self.n_layers = n_layers
        self.topology: Topology | None = None
        self.instances: dict[str, str] = {}  # stage holder -> the process instance that held it at publish
        self.last_epoch = 0  # the newest epoch this controller published
        # The topology an earlier controller published (read at start): who held which stage, so a
        # restarted controller keeps those holders (spares that replaced a worker included) in its first
        # pipeline instead of waiting for regular workers that may be gone.
        self.previous: Topology | None = None

    async def seed(self) -> Topology | None:
        """Read the topology in Redis (an earlier controller's) as :attr:`previous`; None where there is none
        or it does not decode (logged)."""
        raw = await self.redis.get(keys.TOPOLOGY)
        if raw is None:
            return None
        try:
            self.previous = Topology.decode(raw)
        except ValueError as exc:
            log.warning("ignoring the topology in Redis: %s", exc)
            return None
        self.last_epoch = max(self.last_epoch, self.previous.epoch)
        return self.previous

    def forget(self) -> None:
        """Drop the current topology (Redis lost it): the next :meth:`assemble` starts a fresh pipeline."""
        self.topology = None
        self.instances = {}
        self.previous = None

    async def workers(self) -> dict[str, WorkerView]:
        """Every registered worker with its lease status; malformed records are skipped and logged.

        Workers write these records, so nothing in them is trusted to parse: a record, lease or KV key of
        the wrong type (Redis ``WRONGTYPE``), a field that does not decode, or an epoch out of range makes
        that worker's record skipped (logged), never an error out of the control loop."""
        ids = sorted(text(m) for m in await self.redis.smembers(keys.WORKERS))
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(keys.worker(wid))
            pipe.exists(keys.worker_lease(wid))
            pipe.get(keys.worker_kv(wid))
        raw = await pipe.execute(raise_on_error=False)
        out: dict[str, WorkerView] = {}
        for i, wid in enumerate(ids):
            record, alive, kv = raw[3 * i], raw[3 * i + 1], raw[3 * i + 2]
            try:
                if error := next((r for r in (record, alive, kv) if isinstance(r, Exception)), None):
                    raise ValueError(f"Redis refused to read it: {error}")
                info = WorkerInfo.decode(record[b"info"])
                state = WorkerState(record.get(b"state", b"starting").decode())
                epoch, seen = _epoch(record.get(b"epoch", b"0")), _epoch(record.get(b"seen", b"0"))
                held = KVHeld.decode(kv) if kv is not None else KVHeld()
                kv_bytes, kv_mbs = held.bytes, held.microbatches
            except (KeyError, ValueError, AttributeError, TypeError) as exc:
                log.warning("skipping malformed worker record %s: %s", wid, exc)
                continue
            alive = bool(alive)
            if info.worker_id != wid:  # only worker <wid>'s Redis user may write its record: this one is forged
                log.warning("skipping worker record %s: it claims to be worker %s", wid, info.worker_id)
                continue
            out[wid] = WorkerView(info, alive, state, epoch, kv_bytes, kv_mbs, seen)
        return out

    def assemble(self, workers: dict[str, WorkerView]) -> Topology | None:
        """A topology from live workers, keeping current stage holders where alive; None if short."""
        # A draining worker keeps its stage only until someone else can take it.
        live = {w: v for w, v in workers.items() if v.alive and v.state not in _LEAVING}
        colocated = self.settings.mode is Mode.COLOCATED
        prompt = [] if colocated else self._pick(live, WorkerRole.PROMPT, self.settings.prompt_depth, "prompt_stages")
        token = self._pick(live, WorkerRole.TOKEN, self.settings.token_depth, "token_stages")
        if prompt is None or token is None:
            return None
        return Topology(
            epoch=0,
            mode=self.settings.mode.value,
            n_layers=self.n_layers,
            prompt_stages=self._assign(prompt),
            token_stages=self._assign(token),
            prompt_microbatch=self.settings.prompt_microbatch,
            token_microbatch=self.settings.token_microbatch,
        )

    def _pick(self, live: dict[str, WorkerView], role: WorkerRole, depth: int, attr: str) -> list[str] | None:
        holders = self.topology or self.previous
        current = [a.worker_id for a in getattr(holders, attr, ())] if holders else []
        # Keep survivors in their stages; fill holes with other live workers of the role, non-spares first.
        # Spares only ever replace: the first pipeline waits for its regular workers.
        chosen = [w if w in live else None for w in current][:depth] + [None] * max(0, depth - len(current))
        pool = sorted(
            (w for w, v in live.items() if v.info.role is role and w not in chosen and (current or not v.info.spare)),
            key=lambda w: (live[w].info.spare, w),
        )
        for i, w in enumerate(chosen):
            if w is None:
                if not pool:
                    return None
                chosen[i] = pool.pop(0)
        return [w for w in chosen if w is not None]

    def _assign(self, worker_ids: list[str]) -> tuple[StageAssignment, ...]:
        if not worker_ids:
            return ()
        ranges = split_layers(self.n_layers, len(worker_ids))
        pairs = enumerate(zip(worker_ids, ranges, strict=True))
        return tuple(StageAssignment(worker_id=w, stage=s, layers=r) for s, (w, r) in pairs)

    async def publish(
        self,
        topology: Topology,
        workers: dict[str, WorkerView],
        before: Callable[[Topology], Awaitable[None]] | None = None,
        fenced: Callable[[Callable[[Pipeline], None]], Awaitable[None]] | None = None,
    ) -> Topology:
        """Publish ``topology`` under a fresh epoch and return it; ``workers`` is the view it was built from.
        ``before(topology)`` runs once the epoch is chosen and before anyone can see it (a recovery order).
        ``fenced(queue_writes)`` commits the topology's writes (the leader's :meth:`Leadership.fenced`: only
        while it holds the lease); without it they are written plainly.

        Epochs never go backwards, even when Redis restarted empty (its counter starts over): the new
        epoch is above the counter, above every epoch a registered worker has seen (workers accept only
        newer topologies) and above this controller's last one; the counter is raised to it.
        """
        counted = int(await self.redis.incr(keys.EPOCH))
        floor = max([self.last_epoch, *(max(v.epoch, v.seen) for v in workers.values())]) + 1
        epoch = max(counted, floor)
        if epoch > counted:
            log.warning("epoch counter at %d is behind (Redis lost its state?): raising it to %d", counted, epoch)
            await self.redis.set(keys.EPOCH, epoch)
        self.last_epoch = epoch
        topo = topology.model_copy(update={"epoch": epoch})
        if before is not None:
            await before(topo)

        def queue_writes(pipe: Pipeline) -> None:
            pipe.set(keys.TOPOLOGY, topo.encode())
            pipe.publish(keys.TOPOLOGY_CHANNEL, str(epoch))

        if fenced is not None:
            await fenced(queue_writes)
        else:
            async with self.redis.pipeline(transaction=True) as pipe:
                queue_writes(pipe)
                await pipe.execute()
        self.topology = topo
        self.previous = None
        self.instances = {
            a.worker_id: workers[a.worker_id].info.instance for a in (*topo.prompt_stages, *topo.token_stages)
        }
        log.info(
            "published topology epoch %d: prompt=%s token=%s",
            epoch,
            [(a.worker_id, a.layers) for a in topo.prompt_stages],
            [(a.worker_id, a.layers) for a in topo.token_stages],
        )
        return topo

    def ready(self, workers: dict[str, WorkerView]) -> bool:
        """The published pipelines are complete and every stage serves this epoch."""
        topo = self.topology
        if topo is None:
            return False
        for a in (*topo.prompt_stages, *topo.token_stages):
            v = workers.get(a.worker_id)
            if v is None or not v.alive or v.state not in _SERVES or v.epoch != topo.epoch:
                return False
        return True

    def lost(self, workers: dict[str, WorkerView], trust_leases: bool = True) -> list[str]:
        """Stage holders of the current topology whose lease expired or whose process restarted.
        ``trust_leases=False`` (just after a stall, when every lease may have expired at once) counts
        only restarted processes and vanished records."""
        topo = self.topology
        if topo is None:
            return []
        out = []
        for a in (*topo.prompt_stages, *topo.token_stages):
            view = workers.get(a.worker_id)
            expired = view is not None and not view.alive and trust_leases
            if view is None or expired or view.info.instance != self.instances.get(a.worker_id):
                out.append(a.worker_id)
        return out

    def draining(self, workers: dict[str, WorkerView]) -> list[str]:
        """Stage holders of the current topology that are draining (they serve until handed over)."""
        topo = self.topology
        if topo is None:
            return []
        holders = (a.worker_id for a in (*topo.prompt_stages, *topo.token_stages))
        return [w for w in holders if w in workers and workers[w].state is WorkerState.DRAINING]

    @staticmethod
    def replaced(old: Topology, new: Topology, lost: list[str]) -> dict[int, str]:
        """Token stages of ``new`` whose holder is not the process that held them in ``old``
        (another worker, or the same worker id restarted)."""
        before = {a.stage: a.worker_id for a in old.token_stages}
        return {
            a.stage: a.worker_id for a in new.token_stages if before.get(a.stage) != a.worker_id or a.worker_id in lost
        }
