"""The worker's control thread: lease renewal, topology watch and admin commands, once per interval.

One thread does all three so a worker costs Redis one pipelined round trip per heartbeat. The
thread never touches torch or the data plane; it only updates fields the serving loop reads
(``topology``, ``draining``) and, for an admin *kill*, ends the process abruptly.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import redis
from pydantic import ValidationError

from dejavu_common import keys
from dejavu_common.admin import AdminRejected, CommandVerifier
from dejavu_common.fatal import die
from dejavu_common.messages import AdminAction, AdminCommand, KVHeld, Topology, WorkerState
from dejavu_common.settings import Settings
from dejavu_engine.process import MemoryReleaser

log = logging.getLogger("dejavu.worker.heartbeat")


class Heartbeat(threading.Thread):
    def __init__(self, settings: Settings, client: redis.Redis, worker_id: str, instance: str) -> None:
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self.settings = settings
        self.redis = client
        self.worker_id = worker_id
        admin = settings.admin
        self.commands = CommandVerifier(
            admin.verify_key,
            worker_id,
            instance,
            max_ttl_s=admin.command_ttl_s,
            max_pause_s=admin.max_pause_s,
            clock_skew_s=admin.clock_skew_s,
        )
        self.topology: Topology | None = None
        self.topology_changed = threading.Event()
        self.draining = threading.Event()
        self._halt = threading.Event()  # not `_stop`: that name is threading.Thread's own (join calls it)
        self._paused_until = 0.0
        self._admin_cursor = "$"
        self._kv_bytes: dict[str, int] = {}
        self._kv_lock = threading.Lock()
        self.kv_held: Callable[[], tuple[int, int]] | None = None  # (bytes, microbatches) this worker holds
        # Hands freed memory back to the OS once the serving loop has been idle a while (every beat asks).
        self.memory = MemoryReleaser()
        # Writes this worker's registry record again; called when a beat finds it gone (Redis restarted empty).
        self.register: Callable[[], None] | None = None
        self.drain_deadline: float | None = None  # monotonic time a drain gives up waiting for a hand-over

    def add_kv_bytes(self, purpose: str, nbytes: int) -> None:
        """Count KV bytes this worker streamed; flushed to Redis with the next beat."""
        with self._kv_lock:
            self._kv_bytes[purpose] = self._kv_bytes.get(purpose, 0) + nbytes

    @property
    def drain_timeout_s(self) -> float:
        return self.settings.recovery.drain_timeout_s

    def drain_expired(self) -> bool:
        """A drain is under way and its hand-over did not happen in time: the worker leaves anyway."""
        deadline = self.drain_deadline
        return self.draining.is_set() and deadline is not None and time.monotonic() >= deadline

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        """Beat every interval until stopped. A Redis error is logged and waited out (the next beat
        retries); anything else ends the process, since a worker without its control thread keeps
        serving a topology nobody updates."""
        interval = self.settings.recovery.heartbeat_interval_s
        while not self._halt.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            except BaseException as exc:  # a bug: the thread cannot go on
                die(f"heartbeat thread of {self.worker_id}", exc)
            self._halt.wait(interval)

    def beat(self) -> None:
        """Renew the lease (unless paused), register again if the record is gone, refresh the topology,
        apply admin commands."""
        ttl_ms = int(self.settings.recovery.lease_ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        if self.draining.is_set() and self.drain_deadline is None:
            # Tell the controller, which hands the stage over (the serving loop's own state writes say
            # "draining" from now on too); leave after the deadline regardless.
            self.drain_deadline = time.monotonic() + self.settings.recovery.drain_timeout_s
            pipe.hset(keys.worker(self.worker_id), "state", WorkerState.DRAINING.value)
            log.warning("draining: serving on until the stage is handed over (at most %.0f s)", self.drain_timeout_s)
        renew = time.monotonic() >= self._paused_until
        if renew:
            pipe.set(keys.worker_lease(self.worker_id), "1", px=ttl_ms)
        with self._kv_lock:
            counts, self._kv_bytes = self._kv_bytes, {}
        for purpose, n in counts.items():
            pipe.hincrby(keys.KV_BYTES, purpose, n)
        held_mbs = 0
        if self.kv_held is not None:
            held_bytes, held_mbs = self.kv_held()
            held = KVHeld(bytes=held_bytes, microbatches=held_mbs).encode()
            pipe.set(keys.worker_kv(self.worker_id), held, px=4 * ttl_ms)
        pipe.hexists(keys.worker(self.worker_id), "info")  # a record without info is no registration
        pipe.get(keys.TOPOLOGY)
        pipe.xread({keys.ADMIN_STREAM: self._admin_cursor}, count=32, block=None)
        results = pipe.execute()
        self.memory.maybe_release(idle=held_mbs == 0)  # after the lease is renewed: a release takes a while
        registered, raw_topo, admin = results[-3], results[-2], results[-1]
        if not registered and self.register is not None:
            log.warning("registry record of %s is gone (Redis lost its state?): registering again", self.worker_id)
            self.register()
        if raw_topo is not None:
            self._update_topology(raw_topo)
        for _stream, entries in admin or []:
            for entry_id, fields in entries:
                self._admin_cursor = entry_id
                self._admin(fields)
        if self._admin_cursor == "$":
            # Fix the cursor to the stream's current end so no command is missed between beats.
            last = self.redis.xrevrange(keys.ADMIN_STREAM, count=1)
            self._admin_cursor = last[0][0] if last else "0-0"

    def _update_topology(self, raw: bytes) -> None:
        try:
            topo = Topology.decode(raw)
        except ValidationError as exc:
            log.error("ignoring malformed topology: %s", exc)
            return
        if self.topology is None or topo.epoch > self.topology.epoch:
            self.topology = topo
            self.topology_changed.set()

    def _admin(self, fields: dict) -> None:
        try:
            cmd = AdminCommand.decode(fields[b"cmd"])
        except (KeyError, ValidationError) as exc:
            log.error("rejected malformed admin command: %s", exc)
            return
        if not self.commands.addressed_here(cmd):
            return
        try:
            self.commands.check(cmd)
        except AdminRejected as exc:
            log.error("rejected admin command %s: %s", cmd.command_id, exc)
            return
        log.warning("admin command: %s %s", cmd.action.value, cmd.seconds or "")
        if cmd.action is AdminAction.KILL:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, on purpose: no clean-up
        elif cmd.action is AdminAction.PAUSE_HEARTBEATS:
            self._paused_until = time.monotonic() + cmd.seconds
        elif cmd.action is AdminAction.DRAIN:
            self.draining.set()
