"""Stage 0's side of the stages after it, in a request-scheduled pipeline of several stages: the passes it sent
and their returns.

Up to one pass per stage is in flight (the policy keeps a request in one at most). Each goes out as a
:class:`~dejavu_worker.dataplane.SlicePass` to stage 1, after the replicas of what stage 0 wrote in it (stage 1
keeps stage 0's replica, and messages to one peer arrive in the order sent), with the requests that ended since the
previous pass, which every stage forgets; the last stage's :class:`~dejavu_worker.dataplane.PassReturn` comes back
on the token channel. A pass that does not come back within the deadline was lost by the data plane (a dead stage
would have changed the epoch).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dejavu_common.sched import ScheduledPass
from dejavu_token_worker.replication import ReplicaSender
from dejavu_worker.dataplane import PassReturn, SlicePass, WireSlice
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavulib.paged import BlockPool

log = logging.getLogger("dejavu.token_worker.downstream")


@dataclass
class InFlight:
    """A pass sent on: what the policy planned, when stage 0 began it (``started``, ``time.perf_counter()``) and
    when it went out (``sent``, ``time.monotonic()``)."""

    step: ScheduledPass
    started: float
    sent: float = field(default_factory=time.monotonic)


class Downstream:
    """The stages after stage 0 as stage 0 sees them at one epoch: ``next_peer`` (stage 1), ``depth`` passes in
    flight at most, ``deadline_s`` for a pass to come back, ``replicas`` to stage 1 (None: no replication)."""

    def __init__(
        self,
        endpoint: DataEndpoint,
        next_peer: str,
        depth: int,
        deadline_s: float,
        replicas: ReplicaSender | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.next_peer = next_peer
        self.depth = depth
        self.deadline_s = deadline_s
        self.replicas = replicas
        self.inflight: dict[int, InFlight] = {}
        self._ids = itertools.count()

    @property
    def full(self) -> bool:
        return len(self.inflight) >= self.depth

    def send(
        self,
        step: ScheduledPass,
        wire: Sequence[WireSlice],
        hidden: torch.Tensor,
        pool: BlockPool,
        started: float,
        ended: Sequence[int] = (),
        released: Sequence[int] = (),
    ) -> None:
        """Send ``step`` on: the replicas of what stage 0 wrote (from position 0 on a request's first slice since
        it was admitted, where the replica starts), then the pass with its hidden states and the requests that
        ended or were released (preempted) since the last pass."""
        if self.replicas is not None:
            written = [(w.mb, w.table, 0 if w.spec is not None else w.start, w.start + w.length) for w in wire]
            self.replicas.send_slices(pool, written)
        pass_id = next(self._ids)
        message = SlicePass(pass_id, tuple(wire), hidden, tuple(ended), tuple(released))
        self.endpoint.send(self.next_peer, Channel.ACTIVATION, message.encode())
        self.inflight[pass_id] = InFlight(step, started)

    def send_ended(self, ended: Sequence[int], released: Sequence[int] = ()) -> None:
        """Tell the later stages which requests ended or were released, when no pass goes out to carry it."""
        message = SlicePass(next(self._ids), (), None, tuple(ended), tuple(released))
        self.endpoint.send(self.next_peer, Channel.ACTIVATION, message.encode())

    def returns(self, wait: bool) -> Iterator[tuple[InFlight, PassReturn]]:
        """The returns of passes in flight that are here (waiting up to 50 ms for the first when ``wait``)."""
        timeout = 0.05 if wait else 0.0
        while self.inflight:
            payload = self.endpoint.recv(Channel.TOKENS, timeout_s=timeout)
            if payload is None:
                return
            timeout = 0.0
            try:
                answer = PassReturn.decode(bytes(payload))
            except ValueError as exc:
                log.error("dropped a malformed pass return: %s", exc)
                continue
            flight = self.inflight.pop(answer.pass_id, None)
            if flight is None:
                log.info("dropped the return of pass %d: it is no longer in flight", answer.pass_id)
                continue
            yield flight, answer

    def pop_expired(self) -> tuple[int, InFlight] | None:
        """A pass in flight for longer than the deadline, no longer waited for; None when there is none."""
        now = time.monotonic()
        for pass_id, flight in self.inflight.items():
            if now - flight.sent > self.deadline_s:
                del self.inflight[pass_id]
                return pass_id, flight
        return None

    def abandon(self) -> list[ScheduledPass]:
        """Forget every pass in flight (a new epoch: none of them comes back); returns them."""
        steps = [f.step for f in self.inflight.values()]
        self.inflight.clear()
        return steps
