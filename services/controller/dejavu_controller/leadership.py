"""The controller's leader lease: one controller acts on a deployment's Redis at a time.

A controller clears the previous controller's work when it starts, dispatches, relays and repairs;
two doing so at once would drop each other's requests and publish competing topologies. So a
controller acts only while it holds the lease (``keys.CONTROLLER_LEADER``, a value with a TTL), and
a second one waits as a standby (not ready) until the lease is free.

The lease names its holder by ``identity`` (stable across restarts of the same controller: host and
port) plus a fresh instance id. A restarted controller with the same identity takes its own lease
back at once instead of waiting out the TTL its dead predecessor left. A leader that finds the lease
held by another instance has lost it (it stalled longer than the TTL): it must stop acting, and the
backend ends the process, which a supervisor restarts as a standby. Redis errors are not a loss: a
leader that cannot reach Redis cannot act either, and renews once Redis answers again (a Redis that
restarted empty has no lease: the leader takes it again).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from redis import asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, WatchError

from dejavu_common import keys
from dejavu_controller.aio import cancellation_point

log = logging.getLogger("dejavu.controller.leader")


class LeadershipLost(RuntimeError):
    """Another controller instance holds the lease this one held: this one must stop acting."""


class Leadership:
    """The lease of one controller instance; ``ttl_s`` bounds how long a dead leader blocks a standby."""

    def __init__(self, redis: aioredis.Redis, identity: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the lease TTL must be > 0, got {ttl_s}")
        if "/" in identity:
            raise ValueError(f"a controller identity has no '/': {identity!r}")
        self.redis = redis
        self.identity = identity
        self.value = f"{identity}/{uuid.uuid4().hex}"
        self.ttl_s = ttl_s
        self.held = False

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    async def holder(self) -> str | None:
        """The value of the lease as Redis holds it now (None: free)."""
        raw = await self.redis.get(keys.CONTROLLER_LEADER)
        return raw.decode() if isinstance(raw, bytes) else raw

    async def _set_if(self, may_take) -> bool:
        """Set the lease to this instance's value, with the TTL, if ``may_take(current value or None)``;
        atomically (WATCH/MULTI: no scripting right needed). Whether it was set."""
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(keys.CONTROLLER_LEADER)
                raw = await pipe.get(keys.CONTROLLER_LEADER)
                held = raw.decode() if isinstance(raw, bytes) else raw
                if not may_take(held):
                    return False
                pipe.multi()
                pipe.set(keys.CONTROLLER_LEADER, self.value, px=self._ttl_ms)
                await pipe.execute()
                return True
            except WatchError:  # changed under us: someone else wrote it
                return False

    async def try_acquire(self) -> bool:
        """Take the lease if it is free or held by this identity; whether this instance holds it now."""
        mine = f"{self.identity}/"
        self.held = await self._set_if(lambda held: held is None or held.startswith(mine))
        return self.held

    async def acquire(self, poll_s: float | None = None) -> None:
        """Wait until this instance holds the lease; Redis errors are waited out."""
        poll = poll_s if poll_s is not None else self.ttl_s / 3
        reported = None
        while True:
            cancellation_point()
            try:
                if await self.try_acquire():
                    log.info("leader lease taken (%s)", self.value)
                    return
                holder = await self.holder()
                if holder != reported:
                    log.warning("standing by: the leader lease is held by %s", holder)
                    reported = holder
            except RedisError as exc:
                log.warning("leader lease: Redis error while waiting for it (%s)", exc)
            await asyncio.sleep(poll)

    async def renew(self) -> None:
        """Extend the lease (or take it again where Redis lost it). Raises :class:`LeadershipLost` if
        another instance holds it, and :class:`redis.exceptions.RedisError` when Redis cannot be
        reached (not a loss)."""
        if not await self._set_if(lambda held: held is None or held == self.value):
            self.held = False
            raise LeadershipLost(f"the leader lease is now held by {await self.holder()}, not {self.value}")

    async def keep(self) -> None:
        """Renew every third of the TTL until cancelled; raises :class:`LeadershipLost`."""
        while True:
            cancellation_point()
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.renew()
            except RedisError as exc:
                log.warning("leader lease not renewed: Redis error (%s); retrying", exc)

    async def fenced(self, queue_writes: Callable[[Pipeline], None], tries: int = 5) -> None:
        """Commit the writes ``queue_writes(pipe)`` queues, in one transaction that commits only while this
        instance holds the lease: the lease is WATCHed and compared with this instance's value, so a leader
        that stalled past its TTL and lost the lease to another instance cannot write after waking (the
        lease's value is the fencing token, checked by Redis itself). A lease that is gone (Redis restarted
        empty, or it expired and nobody took it) is taken back in the same transaction, as :meth:`renew` takes it.
        Raises :class:`LeadershipLost`.

        The lease's own renewal (:meth:`keep`) also touches the watched key, so a transaction it interrupts
        is tried again while the lease is still this instance's."""
        for _ in range(tries):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(keys.CONTROLLER_LEADER)
                    raw = await pipe.get(keys.CONTROLLER_LEADER)
                    held = raw.decode() if isinstance(raw, bytes) else raw
                    if held not in (None, self.value):
                        self.held = False
                        raise LeadershipLost(f"the leader lease is held by {held}, not {self.value}: write refused")
                    pipe.multi()
                    if held is None:  # gone with a Redis that restarted empty, or expired: taken back, as renew() does
                        pipe.set(keys.CONTROLLER_LEADER, self.value, px=self._ttl_ms)
                        self.held = True
                    queue_writes(pipe)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # renewed (or taken) meanwhile: look again
        raise LeadershipLost(f"the leader lease kept changing under {self.value}: write refused")

    async def release(self) -> None:
        """Give the lease up if this instance holds it (a standby takes over at once)."""
        if self.held:
            self.held = False
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(keys.CONTROLLER_LEADER)
                    if await pipe.get(keys.CONTROLLER_LEADER) in (self.value, self.value.encode()):
                        pipe.multi()
                        pipe.delete(keys.CONTROLLER_LEADER)
                        await pipe.execute()
                except WatchError:
                    pass
