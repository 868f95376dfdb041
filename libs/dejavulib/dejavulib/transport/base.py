"""The one transport interface: ``flush``/``fetch`` of one contiguous chunk, plus peer addressing.

Peers are identified by string ids. A transport exposes ``address`` (bytes a peer needs to reach it;
the serving layer publishes it in Redis) and ``connect(peer_id, address)``.

Contract of the chunk primitives (paper Table 1, lowest level):

* ``flush(peer_id, key, src, deadline_s)`` makes a copy of the contiguous buffer ``src`` available to
  ``peer_id`` under the integer ``key`` (0 <= key < 2**32). It returns once ``src`` may be reused.
* ``fetch(peer_id, key, dst, deadline_s)`` fills the contiguous buffer ``dst`` (exactly as many bytes)
  with what ``peer_id`` flushed under ``key``. Slot transports (disk; the tests' fake) keep the last
  flush per (sender, key) and may be fetched repeatedly; stream transports (UCX) deliver each flush to
  exactly one fetch, FIFO per key. Both raise ``TransferTimeout`` past the deadline. A slot fetched
  while the same (sender, key) is being flushed may mix old and new bytes: order them (the serving layer
  does, through its messages).

``MessageTransport`` adds whole messages (a header blob + a payload) from any peer: each header is
first offered to an admission callback, which authenticates it and says how many payload bytes to
accept, and only then is a payload buffer sized; ``Endpoint`` builds verified, per-channel queues on it.

What serving runs: messages (UCX) between worker processes, and the chunk primitives of ``disk`` for the
replicas a token stage keeps on disk. UCX's chunk primitives carry only the per-chunk baseline that
``dejavu bench streaming`` measures the buffered copy against.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

from dejavulib.buffers import Buffer
from dejavulib.handle import Handle

KEY_LIMIT = 1 << 32
#: Longest header blob a transport reads from a peer; a longer one is dropped unread.
MAX_HEADER_BYTES = 1024


class Admitted(Protocol):
    """What admission returns for a header it accepts: at least the payload size to accept."""

    @property
    def nbytes(self) -> int: ...


A = TypeVar("A", bound=Admitted)
MessageAdmit = Callable[[bytes], A | None]
MessageSink = Callable[[A, np.ndarray], None]
MessageDrop = Callable[[A], None]


def check_key(key: int) -> None:
    if not 0 <= key < KEY_LIMIT:
        raise ValueError(f"key must be in [0, 2**32), got {key}")


class Transport(abc.ABC):
    """Moves contiguous host chunks between peers. Methods are thread-safe unless a subclass says otherwise."""

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id

    @property
    @abc.abstractmethod
    def address(self) -> bytes:
        """What another peer passes to ``connect`` to reach this transport."""

    @abc.abstractmethod
    def connect(self, peer_id: str, address: bytes) -> None:
        """Make ``peer_id`` reachable; raises ``PeerError`` if the address is unusable."""

    @abc.abstractmethod
    def flush(self, peer_id: str, key: int, src: Buffer, deadline_s: float) -> None:
        """Copy contiguous ``src`` to ``peer_id`` under ``key`` (see the module contract)."""

    @abc.abstractmethod
    def fetch(self, peer_id: str, key: int, dst: Buffer, deadline_s: float) -> None:
        """Fill contiguous ``dst`` with ``peer_id``'s chunk under ``key`` (see the module contract)."""

    def discard(self, peer_id: str, key: int) -> None:  # noqa: B027 - stream transports keep nothing
        """Forget the chunk ``peer_id`` flushed here under ``key``: slot transports keep the last flush
        until then (a later ``fetch`` waits as for a chunk never flushed). Stream transports hold
        nothing once fetched: no-op."""

    def receive_path_ok(self, deadline_s: float = 2.0) -> bool:
        """Whether messages sent to this transport still arrive (a dead peer can break a shared-memory
        receive path for good: see the UCX transport). Transports that cannot break so: True."""
        return True

    def forget(self, peer_id: str) -> None:  # noqa: B027 - transports without per-peer state keep nothing
        """Stop sending to ``peer_id`` (it left the deployment, perhaps dead): what is still in flight to it
        fails at once instead of at its deadline, and nothing of it stays pending. A later ``connect``
        starts afresh. No-op where nothing is kept per peer."""

    def close(self) -> None:  # noqa: B027 - transports without resources need no cleanup
        """Release resources; the transport is unusable afterwards. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MessageTransport(Transport):
    """A transport that also carries whole messages from any connected sender."""

    @abc.abstractmethod
    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        """Start sending ``header`` then ``payload`` (uint8, contiguous) to ``peer_id``.

        Returns at once; the handle completes when ``payload`` may be reused, or fails with
        ``PeerError``. The caller keeps ``payload`` alive and unchanged until then. Messages to one
        peer are delivered in the order they were sent.
        """

    @abc.abstractmethod
    def set_message_sink(
        self, admit: MessageAdmit[A], sink: MessageSink[A], drop: MessageDrop[A] | None = None
    ) -> None:
        """Handle incoming messages with these callbacks, all called on the transport's own thread.

        For each message, ``admit(header)`` runs before anything is allocated for its payload (a header
        over ``MAX_HEADER_BYTES`` is dropped unread); ``None`` drops the message. Otherwise exactly
        ``admitted.nbytes`` payload bytes are received (a payload of another size is dropped unread)
        and delivered as ``sink(admitted, payload)``, or, if the message is dropped after all (a payload
        of another size, one that never comes or never completes), ``drop(admitted)`` is called: each
        admitted message ends in exactly one of the two.
        """
