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
import uuid

from dejavu_common import keys
from dejavu_common.messages import StageAssignment, Topology, WorkerInfo, WorkerRole, WorkerState
from dejavu_common.redis_client import sync_client
from dejavu_common.settings import Settings
from dejavu_worker.endpoint import DataEndpoint
from dejavu_worker.heartbeat import Heartbeat

log = logging.getLogger("dejavu.worker")


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

    # -- hooks -------------------------------------------------------------------------------
    def open_data_plane(self) -> bytes:
        """Create the DejaVuLib endpoint; return the address peers connect to."""
        self.endpoint = DataEndpoint(self.settings.transport, self.worker_id)
        return self.endpoint.address

    @abc.abstractmethod
    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        """Hold the assigned stage (load layers, connect peers). Called again after a re-assignment."""

    @abc.abstractmethod
    def serve(self, topology: Topology) -> None:
        """Serve until ``self.epoch_changed()`` or ``self.stopping``; must return promptly then."""

    def close_data_plane(self) -> None:
        """Release the data plane; safe when ``open_data_plane`` never ran."""
        if self.endpoint is not None:
            self.endpoint.close()

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        try:
            self._start()
            while not self.stopping.is_set():
                topo = self._wait_for_stage()
                if topo is None:
                    break
                assignment = topo.stage_of(self.worker_id)
                assert assignment is not None
                if assignment != self.assignment:
                    self.set_state(WorkerState.LOADING, topo.epoch)
                    self.load(assignment, topo)
                    self.assignment = assignment
                self.set_state(WorkerState.SERVING, topo.epoch)
                log.info("serving stage %d layers %s at epoch %d", assignment.stage, assignment.layers, topo.epoch)
                self.serve_epoch = topo.epoch
                self.serve(topo)
            return 0
        finally:
            self.cleanup()

    def _start(self) -> None:
        self.redis = sync_client(self.settings.redis)
        address = self.open_data_plane()
        info = WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            host=socket.gethostname(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex,
            data_address=base64.b64encode(address).decode(),
            torch_threads=self.torch_threads,
            spare=self.spare,
        )
        self.redis.hset(keys.worker(self.worker_id), mapping={"info": info.encode(), "state": "idle", "epoch": 0})
        self.redis.sadd(keys.WORKERS, self.worker_id)
        self.heartbeat = Heartbeat(self.settings, self.redis, self.worker_id, info.instance)
        if self.endpoint is not None:
            self.endpoint.count_kv = self.heartbeat.add_kv_bytes
        self.heartbeat.beat()  # the lease exists before anyone reads the registry
        self.heartbeat.start()
        log.info("registered as %s worker %s (spare=%s)", self.role.value, self.worker_id, self.spare)

    def _wait_for_stage(self) -> Topology | None:
        """Block until the newest topology gives this worker a stage; None when stopping or draining."""
        assert self.heartbeat is not None
        self.set_state(WorkerState.IDLE, 0) if self.assignment is None else None
        while not self.stopping.is_set() and not self.heartbeat.draining.is_set():
            topo = self.heartbeat.topology
            if topo is not None and topo.stage_of(self.worker_id) is not None:
                self.heartbeat.topology_changed.clear()
                return topo
            self.heartbeat.topology_changed.wait(0.2)
            self.heartbeat.topology_changed.clear()
        return None

    def epoch_changed(self) -> bool:
        """True when a newer topology exists (re-assignment or fencing) or the worker must stop."""
        hb = self.heartbeat
        if self.stopping.is_set() or hb is None or hb.draining.is_set():
            return True
        return hb.topology is not None and hb.topology.epoch != getattr(self, "serve_epoch", -1)

    def set_state(self, state: WorkerState, epoch: int) -> None:
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
        log.info("worker %s stopped", self.worker_id)
