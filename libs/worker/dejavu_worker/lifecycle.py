"""One lifecycle for every worker: start -> register -> heartbeat -> (load -> serve)* -> drain -> clean up.

Prompt and token workers subclass :class:`WorkerProcess` and differ only in ``load`` (what their
stage holds) and ``serve`` (what a step does). ``cleanup`` is safe after a failed start.
"""

from __future__ import annotations

import abc
import base64
import logging
import os
import signal
import socket
import threading
import time
import uuid

import redis

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import StageAssignment, Topology, WorkerInfo, WorkerRole, WorkerState
from dejavu_common.redis_client import sync_client
from dejavu_common.settings import Settings
from dejavu_common.signing import EntrySigner
from dejavu_worker.endpoint import DataEndpoint
from dejavu_worker.heartbeat import Heartbeat
from dejavu_worker.metrics import StageSnapshot, WorkerMetrics, metrics_url
from dejavulib.errors import IntegrityError, ProtocolError, TransferError, TransportUnavailable

log = logging.getLogger("dejavu.worker")

# Redis is unreachable (down, restarting, or too slow): the worker waits it out and registers again.
REDIS_LOST: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
# What can end one epoch's serving without anything being wrong with this process: a peer that can't
# be reached or connected to (PeerError, TransportUnavailable, e.g. UCX failing to set up shared memory
# with a new peer), a transfer or wait past its deadline, a malformed peer message, or a Redis reply the
# worker didn't expect (a consumer group removed by a restarted controller). Reported and retried.
SERVE_RETRYABLE: tuple[type[Exception], ...] = (
    redis.RedisError,
    TransferError,
    TransportUnavailable,
    IntegrityError,
    ProtocolError,
    DeadlineExceeded,
)
_MAX_BACKOFF_S = 5.0


class WorkerProcess(abc.ABC):
    role: WorkerRole

    def __init__(self, settings: Settings, worker_id: str, spare: bool = False, torch_threads: int = 1) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.spare = spare
        self.torch_threads = torch_threads
        self.redis = None
        self.heartbeat: Heartbeat | None = None
        self.stopping = threading.Event()
        self.assignment: StageAssignment | None = None
        self.endpoint: DataEndpoint | None = None
        self.info: WorkerInfo | None = None
        self.signer = EntrySigner(worker_id)  # signs its token-stream entries (dejavu_common.signing)
        self._reported: tuple[WorkerState, int] = (WorkerState.IDLE, 0)  # last state and epoch written
        self._min_epoch = 0  # after a Redis outage: serve only topologies newer than the last one served
        self._unassigned_at = 0  # the last epoch whose topology named this worker for no stage
        self.metrics = WorkerMetrics(worker_id, self.role.value)

    # -- hooks -------------------------------------------------------------------------------
    def open_data_plane(self) -> bytes:
        """Create the DejaVuLib endpoint; return the address peers connect to. Its data-plane key is
        published with it (``WorkerInfo.data_key``); senders' keys are looked up through ``self.redis``."""
        self.endpoint = DataEndpoint(self.settings.transport, self.worker_id, registry=self.redis)
        return self.endpoint.address

    @abc.abstractmethod
    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        """Hold the assigned stage (load layers, connect peers). Called again after a re-assignment."""

    @abc.abstractmethod
    def serve(self, topology: Topology) -> None:
        """Serve until ``self.epoch_changed()`` or ``self.stopping``; must return promptly then.

        After a :data:`SERVE_RETRYABLE` error it is called again with the same topology (see :meth:`run`):
        what the worker held when the error came is still its own, and the epoch's work is continued, not
        started over (nor forgotten): whatever the error broke is run again or failed to its clients."""

    def unassigned(self, epoch: int) -> None:
        """The topology of ``epoch`` gives this worker no stage (it was fenced, or its stage handed over):
        what it holds for the stage it served is no one's now (the new holder restores from its peers), so
        a subclass frees it here."""
        if self.assignment is not None:
            log.info("the topology of epoch %d gives %s no stage: it stands by", epoch, self.worker_id)
        if self.endpoint is not None:  # its peers forgot it: connections kept from before would lead nowhere
            self.endpoint.forget_peers()

    def snapshot(self) -> StageSnapshot:
        """What this worker holds now, for its metrics; called on the scraping thread, so it reads without
        waiting on the serving loop. A subclass adds what its stage holds."""
        return StageSnapshot(stage=self.assignment.stage if self.assignment else None, epoch=self._reported[1])

    def close_data_plane(self) -> None:
        """Release the data plane; safe when ``open_data_plane`` never ran."""
        if self.endpoint is not None:
            self.endpoint.close()

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped or drained; returns the exit code.

        Redis lost (connection or timeout errors): wait for it, register again as a new instance
        (the controller then treats this worker like a restarted one) and wait for a newer topology.
        A failure of one epoch's serving that is not this process's own (:data:`SERVE_RETRYABLE`: a
        peer that can't be reached, a Redis reply it didn't expect): report it, back off, serve the same
        epoch again (``serve`` continues it), or the newer one that came meanwhile.
        Anything else is a local, fatal error and propagates.
        """
        if threading.current_thread() is threading.main_thread():  # tests run workers as threads
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._start()
            failures = 0
            while not self.stopping.is_set():
                try:
                    if not self._serve_next():
                        break
                    failures = 0
                except REDIS_LOST as exc:
                    self._rejoin(exc)
                except SERVE_RETRYABLE as exc:
                    failures += 1
                    self._back_off(exc, failures)
            return 0
        finally:
            self.cleanup()

    def _on_sigterm(self, *_: object) -> None:
        """The first SIGTERM drains (rolling updates hand the stage over instead of failing it); a
        second one stops at once. Only sets events: a signal handler must not touch Redis."""
        if self.heartbeat is None or self.heartbeat.draining.is_set():
            self.stopping.set()
        else:
            self.heartbeat.draining.set()

    def _serve_next(self) -> bool:
        """Wait for a stage, hold it and serve one epoch; False when stopping or drained."""
        topo = self._wait_for_stage()
        if topo is None:
            return False
        assignment = topo.stage_of(self.worker_id)
        assert assignment is not None
        if assignment != self.assignment:
            self.set_state(WorkerState.LOADING, topo.epoch)
            self.assignment = None  # a load that fails half way holds nothing
            self.load(assignment, topo)
            self.assignment = assignment
        self.set_state(WorkerState.SERVING, topo.epoch)
        log.info("serving stage %d layers %s at epoch %d", assignment.stage, assignment.layers, topo.epoch)
        self.serve_epoch = topo.epoch
        self.serve(topo)
        return True

    def _start(self) -> None:
        self.redis = sync_client(self.settings.redis)
        address = self.open_data_plane()
        url = self._serve_metrics()
        self.info = WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            host=socket.gethostname(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex,
            data_address=base64.b64encode(address).decode(),
            torch_threads=self.torch_threads,
            spare=self.spare,
            metrics_url=url,
            entry_key=self.signer.public_key,
            data_key=self.endpoint.data_key if self.endpoint is not None else "",
        )
        self.register()
        self.heartbeat = Heartbeat(self.settings, self.redis, self.worker_id, self.info.instance)
        self.heartbeat.register = self.register
        if self.endpoint is not None:
            self.endpoint.count_kv = self.heartbeat.add_kv_bytes
        self.heartbeat.beat()  # the lease exists before anyone reads the registry
        self.heartbeat.start()
        log.info("registered as %s worker %s (spare=%s)", self.role.value, self.worker_id, self.spare)

    def _serve_metrics(self) -> str | None:
        """Count the data plane's traffic and serve the metrics on ``worker.metrics_port`` (when set); the
        URL published in the registry record, or None."""
        if self.endpoint is not None:
            self.endpoint.record_to(self.metrics.dataplane)
        endpoint = self.endpoint
        self.metrics.watch(self.snapshot, lambda: dict(endpoint.stats) if endpoint is not None else {})
        port = self.settings.worker.metrics_port
        if port is None:
            return None
        host = self.settings.worker.metrics_host
        return metrics_url(host, self.settings.transport.host, self.metrics.serve(host, port))

    def register(self) -> None:
        """Write this worker's registry record (info, current state and epoch) and index entry.

        Called at start, and again (from the heartbeat thread or after a Redis outage) when Redis lost
        them; the state and epoch are the last ones this worker reported, and ``seen`` the newest topology
        epoch it accepted: the controller publishes above it, so the worker's fencing (it accepts only
        newer epochs) never shuts out the controller's next topology.
        """
        assert self.redis is not None and self.info is not None
        state, epoch = self._reported
        seen = self.heartbeat.topology.epoch if self.heartbeat and self.heartbeat.topology else 0
        record = {"info": self.info.encode(), "state": state.value, "epoch": epoch, "seen": max(seen, epoch)}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(keys.worker(self.worker_id), mapping=record)
        pipe.sadd(keys.WORKERS, self.worker_id)
        pipe.execute()

    def _rejoin(self, exc: Exception) -> None:
        """Redis went away under this worker: wait for it (bounded backoff), then register again as a
        new instance that holds nothing, and serve only a topology newer than the last one served."""
        assert self.redis is not None and self.info is not None
        log.error("lost Redis (%s): waiting for it, then registering again as a new instance", exc)
        self._min_epoch = max(self._min_epoch, getattr(self, "serve_epoch", 0) + 1)
        self.assignment = None  # reloaded on the next stage: a new instance holds no microbatch state
        delay, waited = 0.1, 0.0
        while not self.stopping.is_set():
            try:
                self.info = self.info.model_copy(update={"instance": uuid.uuid4().hex})
                if self.heartbeat is not None:  # admin commands name the instance they are for
                    self.heartbeat.commands.instance = self.info.instance
                self._reported = (WorkerState.IDLE, self._reported[1])
                self.register()
                log.warning("Redis is back after %.1f s: registered again as instance %s", waited, self.info.instance)
                return
            except REDIS_LOST as again:
                if waited == 0.0 or delay >= _MAX_BACKOFF_S:
                    log.warning("Redis still unreachable (%s); retrying every %.1f s", again, delay)
                self.stopping.wait(delay)
                waited += delay
                delay = min(2 * delay, _MAX_BACKOFF_S)

    def _back_off(self, exc: Exception, failures: int) -> None:
        """Report a failed epoch and wait (exponential backoff, bounded) before serving again; a newer
        topology, a drain past its deadline or a stop ends the wait early."""
        delay = min(0.2 * 2 ** (failures - 1), _MAX_BACKOFF_S)
        log.error(
            "serving epoch %s failed (%s: %s, %d in a row): serving again in %.1f s",
            getattr(self, "serve_epoch", None),
            type(exc).__name__,
            exc,
            failures,
            delay,
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self.epoch_changed():
            self.stopping.wait(0.05)

    def _wait_for_stage(self) -> Topology | None:
        """Block until the newest topology gives this worker a stage; None when stopping, or when
        draining and the stage was handed over (or never held, or the drain's deadline passed)."""
        hb = self.heartbeat
        assert hb is not None
        self.set_state(WorkerState.IDLE, 0) if self.assignment is None else None
        while not self.stopping.is_set():
            topo = hb.topology
            holds = topo is not None and topo.epoch >= self._min_epoch and topo.stage_of(self.worker_id) is not None
            if topo is not None and not holds and topo.epoch > self._unassigned_at:
                self._unassigned_at = topo.epoch
                self.unassigned(topo.epoch)
            if hb.draining.is_set() and (not holds or hb.drain_expired()):
                return None
            if holds:
                hb.topology_changed.clear()
                return topo
            hb.topology_changed.wait(0.2)
            hb.topology_changed.clear()
        return None

    def epoch_changed(self) -> bool:
        """True when a newer topology exists (re-assignment or fencing) or the worker must stop.

        A draining worker serves on until the controller has handed its stage over (a newer topology
        without it) or the drain's deadline passes; ``_wait_for_stage`` then lets it leave."""
        hb = self.heartbeat
        if self.stopping.is_set() or hb is None or hb.drain_expired():
            return True
        return hb.topology is not None and hb.topology.epoch != getattr(self, "serve_epoch", -1)

    def set_state(self, state: WorkerState, epoch: int) -> None:
        if state is WorkerState.SERVING and self.heartbeat is not None and self.heartbeat.draining.is_set():
            state = WorkerState.DRAINING  # still serving, but the controller must keep handing the stage over
        self._reported = (state, epoch)
        if self.redis is not None:
            self.redis.hset(keys.worker(self.worker_id), mapping={"state": state.value, "epoch": epoch})

    def cleanup(self) -> None:
        """Deregister and release everything; safe after a partial start."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            if self.redis is not None:
                self.set_state(WorkerState.STOPPED, 0)
                self.redis.delete(keys.worker_lease(self.worker_id))
                self.redis.srem(keys.WORKERS, self.worker_id)
                self.redis.delete(keys.worker(self.worker_id))
        except Exception as exc:  # Redis may be gone already at shutdown
            log.warning("could not deregister: %s", exc)
        self.close_data_plane()
        self.metrics.close()
        log.info("worker %s stopped", self.worker_id)
