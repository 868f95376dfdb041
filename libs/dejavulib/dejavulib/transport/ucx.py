"""UCX transport (ucxx): tag-matched, zero-copy transfers of host buffers between processes and hosts.

One I/O thread owns the UCX worker; every other thread only enqueues operations, so the transport is
thread-safe without relying on UCX's multi-thread mode. Endpoints are created from the peer's
*worker address* with endpoint error handling OFF: on one host that is what lets UCX pick its
shared-memory transports (MEASUREMENTS.md). The price is that UCX never reports a dead peer, so every
blocking call has a deadline and raises ``TransferTimeout`` when it passes.

Progress modes: ``polling`` spins on ``worker.progress()`` while there is traffic (microsecond
latency) and backs off to short sleeps when idle; ``thread`` sleeps in ``epoll`` on the worker's event
fd between events (less CPU, higher latency). In ``thread`` mode an eventfd of ours sits in the same
epoll set, so an operation enqueued by another thread wakes the I/O thread at once, and an idle
transport costs next to no CPU — which matters where workers share cores with the model's compute. The
waits are still capped (20 ms idle, 2 ms with requests outstanding), so a UCX event that never comes
delays a transfer by milliseconds, never stalls it.

Every request outstanding for over 5 s is logged once, with its peer and size. ``forget`` drops a peer
that left (a dead one): its outstanding sends fail at once and stop counting as traffic, and its endpoint is
closed without waiting. What UCX may still read of it (sends not yet completed) stays referenced in
``_abandoned`` until UCX settles each (it fails a dead local peer's sends within a second) and the close
completes; then nothing of the peer is kept.
``receive_path_ok`` checks that messages sent to this worker still arrive: a peer killed while writing
into this worker's shared-memory FIFO blocks it for good (see there).

Tags (64 bits): kind (4) | sender id hash (28) | key or sequence number (32).

What a peer can make this transport allocate: a header is received only if it is at most
``MAX_HEADER_BYTES`` long, and a payload buffer is sized only after the header passed admission (the
endpoint authenticates it) and only if the payload's length is exactly what the header declared; any
other message is received into a one-byte buffer, which UCX completes as truncated, and dropped.

Messages from one sender are delivered in the order they were sent. UCX matches a sender's headers in
order, but a small message completes long before a large one sent just ahead of it (eager versus
rendezvous), so each sender has an inbox: a message takes its place when its header is probed and is
handed to the sink only once everything ahead of it was delivered or dropped. Every header, with a
payload or not, has the one header kind, so headers are probed in the order they arrived.

A message whose payload never completes (its sender died mid-message) is given up after
``_INBOUND_GIVE_UP_S``. UCX cannot cancel a receive it has matched, so the receive stays posted and UCX
keeps a pointer into its buffer: the buffer's pages are handed back to the kernel (:mod:`.pages`), the
buffer itself stays referenced in ``_stranded`` until UCX completes the receive, if ever. ``held_bytes`` is
the payload memory this transport holds for messages not yet handed to the sink; the sink's owner learns of
each admitted message dropped instead of delivered (``set_message_sink``'s ``drop``), so its own accounting
of what it admitted stays exact.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import select
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dejavulib.buffers import Buffer, as_bytes
from dejavulib.errors import ClosedError, PeerError, TransferTimeout, TransportUnavailable
from dejavulib.handle import Handle
from dejavulib.transport.base import (
    MAX_HEADER_BYTES,
    Admitted,
    MessageAdmit,
    MessageDrop,
    MessageSink,
    MessageTransport,
    check_key,
)
from dejavulib.transport.interfaces import interface_of
from dejavulib.transport.pages import release_pages

log = logging.getLogger(__name__)

KIND_CHUNK, KIND_HEADER, KIND_PAYLOAD, KIND_HELLO, KIND_PROBE = 1, 2, 3, 4, 5
_KIND_MASK = 0xF << 60
_UNUSED_KINDS = (0, *range(6, 16))  # no sender of ours tags a message so: discarded as they come (``_sweep``)
# At most this many stray messages are discarded per housekeeping pass (a flood costs each pass a bound).
_SWEEP_LIMIT = 65536
_IDLE_SPIN_S = 0.0002  # keep spinning this long after the last event: replies usually follow quickly
_IDLE_SLEEP_MIN_S = 0.00005
_IDLE_SLEEP_MAX_S = 0.0005  # bounds the extra latency of the first message after a quiet spell
_FRESH_S = 0.5  # requests younger than this keep the loop spinning; older ones (a dead peer's) do not
_MAX_LOOP_FAILURES = 20  # I/O passes failing in a row before the transport declares itself dead
# Thread mode: the longest epoll sleep, idle (incoming traffic and our own ops wake it earlier) and with
# requests outstanding. UCX's events should wake the thread whenever there is progress to make; these caps
# bound what a missed one costs (a rendezvous takes several round trips), at 50 wake-ups a second idle.
_EVENT_WAIT_MS = 20
_PENDING_EVENT_WAIT_MS = 2
_HOUSEKEEPING_S = 1.0  # how often outstanding requests and inboxes are checked for stalls
_STALL_REPORT_S = 5.0  # a request outstanding this long is logged (once), with its peer and size
# A message whose header arrived this long ago and whose payload is still incomplete is given up (its
# sender died mid-message, or the transfer broke): the sender's later messages are delivered again,
# instead of waiting behind it for ever (a restarted worker of the same id is the same sender here).
_INBOUND_GIVE_UP_S = 30.0
SHARED_MEMORY_TLS = frozenset({"sysv", "posix", "cma", "xpmem", "knem"})
_TL_PATTERN = re.compile(r"\|\s*([a-z][a-z0-9_]*)/[a-z0-9_.:-]+\s*\|")
# Refused headers whose payloads are still to be discarded: at most this many, each for this long (a
# payload follows its header at once; a "header" whose payload never comes must not cost probes forever).
_REFUSED_MEMORY = 1024
_REFUSED_TTL_S = 5.0
# A payload is sent right after its header; one not probed within this long never comes (its sender died),
# and its place in the sender's order is given up so the sender's later messages flow again.
_PAYLOAD_WAIT_S = 5.0


def peer_hash(peer_id: str) -> int:
    """28-bit id of a peer inside tags."""
    return zlib.crc32(peer_id.encode()) & 0x0FFFFFFF


def make_tag(kind: int, sender: int, key: int) -> int:
    return (kind << 60) | (sender << 32) | key


def selected_transports(worker_info: str) -> frozenset[str]:
    """UCX transport layer names (``sysv``, ``cma``, ``tcp``...) in a worker's protocol tables."""
    return frozenset(_TL_PATTERN.findall(worker_info))


def satisfies(required: str, selected: frozenset[str]) -> bool:
    """Whether ``selected`` transports include ``required`` (``sm``/``shm`` mean any shared-memory one)."""
    if required in ("sm", "shm"):
        return bool(selected & SHARED_MEMORY_TLS)
    return required in selected


@dataclass
class _Inbound:
    """One message from a sender, in its place in that sender's inbox until delivered or dropped."""

    admitted: Admitted | None = None
    payload: np.ndarray | None = None
    ready: bool = False  # header (and payload, if any) received: deliverable
    dropped: bool = False  # refused, failed or never completed: skipped
    since: float = field(default_factory=time.monotonic)
    receive: _Pending | None = None  # the payload's receive, once posted
    held: int = 0  # bytes of payload buffer counted in ``held_bytes`` for it


@dataclass
class _Pending:
    request: Any
    on_done: Callable[[BaseException | None], None]
    keepalive: tuple[Any, ...] = field(default_factory=tuple)
    posted: float = field(default_factory=time.monotonic)
    peer: str = ""  # a send's destination ("" for receives)
    nbytes: int = 0
    reported: bool = False  # logged as stalled


@dataclass
class _Abandoned:
    """What UCX may still use of a forgotten peer: its endpoint (closing) and its sends not yet settled."""

    peer: str
    endpoint: Any  # None: there was none
    closing: Any  # the endpoint's close request (None: none started)
    sends: list[_Pending]


#: UCX transports a worker uses (``UCX_TLS``; the environment's wins). Cross-memory attach (``cma``) is
#: left out: its zero-copy rendezvous has the *receiver* read the sender's memory with process_vm_readv,
#: and with endpoint error handling off (what lets UCX use shared memory at all) a sender that dies
#: mid-message makes UCX abort the receiver ("cma_ep.c: process_vm_readv ... No such process"): one
#: failure became two. Without it, large messages go through shared-memory segments (copy in, copy out),
#: and a dead sender leaves the receiver a message that never completes, which its deadlines handle.
DEFAULT_TLS = "^cma"


class UcxTransport(MessageTransport):
    """See the module docstring. ``require`` names a transport that every connection must select;
    ``host`` binds the data plane to the interface carrying that address (``UCX_NET_DEVICES``, unless
    the environment sets it already; None or a wildcard: every interface); ``tls`` is ``UCX_TLS``
    (unless the environment sets it; None: UCX's choice, cma included). ``chunks``: whether this transport
    serves ``flush``/``fetch``; without them (messages only, as workers use it) chunks that arrive are
    discarded, instead of waiting in UCX's unexpected queue for a ``fetch`` that never comes."""

    def __init__(
        self,
        self_id: str,
        progress: str = "polling",
        require: str | None = None,
        host: str | None = None,
        tls: str | None = DEFAULT_TLS,
        chunks: bool = True,
    ) -> None:
        super().__init__(self_id)
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        if progress not in ("polling", "thread"):
            raise ValueError(f"progress must be 'polling' or 'thread', got {progress!r}")
        self._api, self._Array = ucx_api, Array
        self.progress_mode, self.require, self.chunks = progress, require, chunks
        self._hash = peer_hash(self_id)
        config = {"PROTO_INFO": "y"}
        if tls is not None and "UCX_TLS" not in os.environ:
            config["TLS"] = tls
        device = interface_of(host) if host is not None and "UCX_NET_DEVICES" not in os.environ else None
        if device is not None:
            config["NET_DEVICES"] = device
            log.info("UCX data plane of %s bound to %s (%s)", self_id, device, host)
        self._context = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        self._wake_fd: int | None = None
        if progress == "thread":
            self._worker.init_blocking_progress_mode()
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            # A duplicate descriptor of the worker's epoll instance: registering through it adds our
            # eventfd to the set the worker's progress_worker_event() waits on. Closing it keeps the set.
            with select.epoll.fromfd(os.dup(self._worker.epoll_file_descriptor)) as worker_epoll:
                worker_epoll.register(self._wake_fd, select.EPOLLIN)
        self._address = self._worker.address.tobytes()
        self._endpoints: dict[str, Any] = {}
        self._ops: collections.deque[tuple[Callable[[], None], Handle]] = collections.deque()
        self._pending: list[_Pending] = []
        # Forgotten peers' endpoints (closing) and unsettled sends, kept while UCX may still use them.
        self._abandoned: list[_Abandoned] = []
        # Payload receives given up while posted (UCX cannot cancel them), their buffers' pages released.
        self._stranded: list[_Pending] = []
        self.held_bytes = 0  # payload buffer bytes of messages not yet handed to the sink (I/O thread writes)
        self._housekept = time.monotonic()
        # Receive-path probes (``receive_path_ok``): a second UCX worker of this process sends to this one.
        self._prober: tuple[Any, Any] | None = None
        self._probe_sends: list[tuple[Any, np.ndarray]] = []  # kept while UCX may still read them
        self._probes_sent = 0
        self._probes_seen = 0
        self._probe_lock = threading.Lock()
        self._awaiting_payload: list[tuple[int, int, _Inbound]] = []
        self._admitting: set[tuple[int, int]] = set()  # (sender, seq) of headers received, not yet admitted
        self.swept = 0  # stray messages discarded from UCX's unexpected queue (``_sweep``)
        self._inbox: dict[int, collections.deque[_Inbound]] = {}  # per sender, in the order sent
        self._refused: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=_REFUSED_MEMORY)
        self._admit: MessageAdmit | None = None
        self._sink: MessageSink | None = None
        self._drop: MessageDrop | None = None
        self._seq = 0
        self._seq_lock = threading.Lock()
        self.selected: dict[str, frozenset[str]] = {}
        self._running = True
        self.loop_iterations = 0  # I/O loop passes, for tests and diagnostics (an idle loop should sleep)
        self._last_activity, self._idle_sleep = time.monotonic(), _IDLE_SLEEP_MIN_S
        # Called (on the I/O thread) when the loop gives up; a worker points it at ending its process.
        self.on_failure: Callable[[BaseException], None] = lambda exc: log.critical("UCX transport is dead: %s", exc)
        self._thread = threading.Thread(target=self._loop, name=f"ucx-io-{self_id}", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------

    @property
    def address(self) -> bytes:
        return self._address

    def connect(self, peer_id: str, address: bytes, deadline_s: float = 10.0) -> None:
        """Create the endpoint, exchange a hello, log the selected transports, enforce ``require``.

        ``selected[peer_id]`` is read from the worker's protocol tables, which accumulate over every endpoint
        configuration the worker has used so far: on a host where all peers are local it is exact.
        Raises ``PeerError`` (bad address, no hello within ``deadline_s``) or ``TransportUnavailable``.
        """
        done = Handle()

        def op() -> None:
            try:
                ucx_address = self._api.UCXAddress.create_from_buffer(address)
                ep = self._api.UCXEndpoint.create_from_worker_address(self._worker, ucx_address, False)
            except Exception as exc:
                done.set_done(PeerError(f"cannot create a UCX endpoint to {peer_id!r}: {exc}"))
                return
            if peer_id in self._endpoints:
                self._forget(peer_id, PeerError(f"reconnected to {peer_id!r}"))
            self._endpoints[peer_id] = ep
            hello = np.zeros(1, np.uint8)
            self._post_send(ep, hello, make_tag(KIND_HELLO, self._hash, 0), done.set_done, peer_id)

        self._submit(op, done)
        try:
            done.wait(deadline_s)
        except TransferTimeout as exc:
            raise PeerError(f"UCX hello to {peer_id!r} not delivered within {deadline_s} s") from exc
        selected = self._call(lambda: selected_transports(self._worker.info), deadline_s)
        self.selected[peer_id] = selected
        log.info("UCX to %s uses transports %s (progress=%s)", peer_id, sorted(selected), self.progress_mode)
        if self.require and not satisfies(self.require, selected):
            self._call(lambda: self._endpoints.pop(peer_id, None), deadline_s)
            raise TransportUnavailable(
                f"UCX selected {sorted(selected)} to {peer_id!r}, but transport {self.require!r} is required"
            )

    def flush(self, peer_id: str, key: int, src: Buffer, deadline_s: float) -> None:
        check_key(key)
        data = as_bytes(src)
        done = Handle(data.nbytes)
        tag = make_tag(KIND_CHUNK, self._hash, key)
        self._submit(lambda: self._post_send(self._ep(peer_id), data, tag, done.set_done, peer_id), done)
        done.wait(deadline_s)

    def fetch(self, peer_id: str, key: int, dst: Buffer, deadline_s: float) -> None:
        """Receive into ``dst``; after a ``TransferTimeout`` the receive stays posted and ``dst`` may still be
        written if the chunk arrives later, so do not reuse ``dst`` for anything else."""
        check_key(key)
        if not self.chunks:
            raise ValueError("this transport takes no chunks (chunks=False)")
        out, done = as_bytes(dst), Handle(0)
        tag = self._api.UCXXTag(make_tag(KIND_CHUNK, peer_hash(peer_id), key))

        def op() -> None:
            request = self._worker.tag_recv(self._Array(out), tag)
            self._pending.append(_Pending(request, done.set_done, (out,)))

        self._submit(op, done)
        done.wait(deadline_s)

    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        done = Handle(payload.nbytes)
        with self._seq_lock:
            seq, self._seq = self._seq, (self._seq + 1) & 0xFFFFFFFF
        head = np.frombuffer(header, dtype=np.uint8)

        def op() -> None:
            ep = self._ep(peer_id)
            if payload.nbytes == 0:  # a header declaring no payload: nothing follows it
                self._post_send(ep, head, make_tag(KIND_HEADER, self._hash, seq), done.set_done, peer_id)
                return
            remaining = [2]

            def one_done(error: BaseException | None) -> None:
                remaining[0] -= 1
                if error is not None or remaining[0] == 0:
                    done.set_done(error)

            self._post_send(ep, head, make_tag(KIND_HEADER, self._hash, seq), one_done, peer_id)
            self._post_send(ep, payload, make_tag(KIND_PAYLOAD, self._hash, seq), one_done, peer_id)

        try:
            self._submit(op, done)
        except ClosedError as exc:
            done.set_done(exc)
        return done

    def set_message_sink(self, admit: MessageAdmit, sink: MessageSink, drop: MessageDrop | None = None) -> None:
        self._admit, self._sink, self._drop = admit, sink, drop

    def receive_path_ok(self, deadline_s: float = 2.0) -> bool:
        """Whether a message sent to this worker over the host's transports still arrives.

        UCX's shared-memory transports deliver through a FIFO in the receiver's memory that senders write
        into: a sender killed in the middle of writing an element leaves it unfinished for ever, and the
        receiver reads nothing past it again, from any sender (seen as a stage whose every rendezvous send
        stalled after a peer was SIGKILLed: the replies never got through). Nothing in UCX reports it.
        The probe: a second UCX worker of this process, connected like a peer on this host, sends one
        small message; False if it does not arrive within ``deadline_s``."""
        with self._probe_lock:
            self._probes_sent += 1
            seq = self._probes_sent
            try:
                self._call(lambda: self._send_probe(seq), deadline_s)
            except TransferTimeout:
                return False  # the I/O thread itself is stuck
            end = time.monotonic() + deadline_s
            while self._probes_seen < seq:
                if time.monotonic() > end:
                    return False
                time.sleep(0.002)
            return True

    def forget(self, peer_id: str, deadline_s: float = 10.0) -> None:
        """See :meth:`Transport.forget`: sends still outstanding to ``peer_id`` fail with ``PeerError``."""
        if self._running:
            self._call(lambda: self._forget(peer_id, PeerError(f"peer {peer_id!r} was forgotten")), deadline_s)

    def close(self) -> None:
        """Stop the I/O thread and cancel outstanding requests. Idempotent; never waits on a peer."""
        if not self._running:
            return
        self._running = False
        self._wake()
        self._thread.join(5)
        if self._wake_fd is not None and not self._thread.is_alive():
            os.close(self._wake_fd)
            self._wake_fd = None
        for pending in self._pending:
            pending.on_done(ClosedError("transport closed"))
        self._worker.cancel_inflight_requests()
        self._pending.clear()
        # Dropped unclosed, an endpoint would close itself blocking, flushing what a live peer never takes.
        for peer_id, ep in self._endpoints.items():
            self._abandoned.append(_Abandoned(peer_id, ep, self._start_close(peer_id, ep), []))
        self._endpoints.clear()

    # ---- helpers run on the I/O thread ----------------------------------------------------------

    def _ep(self, peer_id: str) -> Any:
        ep = self._endpoints.get(peer_id)
        if ep is None:
            raise PeerError(f"peer {peer_id!r} is not connected")
        return ep

    def _post_send(self, ep: Any, data: np.ndarray, tag: int, on_done: Callable[[BaseException | None], None],
                   peer: str) -> None:  # fmt: skip
        request = ep.tag_send(self._Array(data), self._api.UCXXTag(tag))
        self._pending.append(_Pending(request, on_done, (data,), peer=peer, nbytes=data.nbytes))

    def _send_probe(self, seq: int) -> None:
        """Post probe ``seq`` from the prober worker (made at the first probe). On the I/O thread."""
        if self._prober is None:
            prober = self._api.UCXWorker(self._context)
            address = self._api.UCXAddress.create_from_buffer(self._address)
            self._prober = (prober, self._api.UCXEndpoint.create_from_worker_address(prober, address, False))
        prober, ep = self._prober
        buf = np.zeros(1, np.uint8)
        request = ep.tag_send(self._Array(buf), self._api.UCXXTag(make_tag(KIND_PROBE, self._hash, seq)))
        prober.progress()  # one byte: shared memory sends it at once; TCP once connected (see ``_probe``)
        self._probe_sends = [(r, b) for r, b in self._probe_sends if not r.completed] + [(request, buf)]

    def _forget(self, peer_id: str, error: BaseException) -> None:
        """Drop ``peer_id``'s endpoint (closed without waiting) and fail its outstanding sends (their
        buffers kept while UCX may still read them: ``_prune_abandoned``). On the I/O thread."""
        ep = self._endpoints.pop(peer_id, None)
        gone = [p for p in self._pending if p.peer == peer_id]
        if ep is None and not gone:
            return
        self._pending = [p for p in self._pending if p.peer != peer_id]
        self._abandoned.append(_Abandoned(peer_id, ep, self._start_close(peer_id, ep), gone))
        for p in gone:
            p.on_done(error)
        if gone:
            log.info("forgot peer %s with %d sends outstanding (%d bytes)", peer_id, len(gone),
                     sum(p.nbytes for p in gone))  # fmt: skip

    def _start_close(self, peer_id: str, ep: Any) -> Any:
        """Start closing ``ep`` without waiting: its close request, or None (no endpoint, or the close did not
        start: the endpoint is then kept for good, since dropping it would close it blocking). A close that
        flushes: endpoint error handling is off, so UCX allows no forced close; for a dead peer it completes
        at once. On the I/O thread."""
        if ep is None:
            return None
        try:
            return ep.close()
        except Exception as exc:
            log.warning("could not start closing the endpoint to %s (kept): %s", peer_id, exc)
            return None

    def _submit(self, op: Callable[[], None], handle: Handle) -> None:
        """Run ``op`` on the I/O thread; if it raises, ``handle`` fails with ``PeerError``."""
        if not self._running:
            raise ClosedError("transport closed")
        self._ops.append((op, handle))
        self._wake()

    def _wake(self) -> None:
        """Interrupt the I/O thread's epoll sleep (thread mode; polling mode never sleeps long)."""
        if self._wake_fd is not None:
            with contextlib.suppress(OSError):  # closed concurrently: the thread is gone anyway
                os.eventfd_write(self._wake_fd, 1)

    def _call(self, fn: Callable[[], Any], deadline_s: float) -> Any:
        """Run ``fn`` on the I/O thread and return its result."""
        box: list[Any] = []
        done = Handle()

        def op() -> None:
            box.append(fn())
            done.set_done()

        self._submit(op, done)
        done.wait(deadline_s)
        return box[0]

    def _loop(self) -> None:
        """The I/O thread's body. An error in one pass is logged and the loop goes on; errors in
        ``_MAX_LOOP_FAILURES`` passes in a row mean the UCX worker is broken: the transport closes
        (every waiter fails at once instead of at its deadline) and ``on_failure`` is called."""
        failures = 0
        while self._running:
            try:
                self._loop_pass()
                failures = 0
            except Exception as exc:
                failures += 1
                log.exception("UCX I/O pass failed (%d in a row)", failures)
                if failures >= _MAX_LOOP_FAILURES:
                    self._fail_all(exc)
                    self.on_failure(exc)
                    return
                time.sleep(0.001 * failures)

    def _fail_all(self, exc: BaseException) -> None:
        self._running = False
        error = ClosedError(f"UCX I/O thread failed: {exc}")
        while self._ops:
            self._ops.popleft()[1].set_done(error)
        for pending in self._pending:
            pending.on_done(error)
        self._pending.clear()

    def _loop_pass(self) -> None:
        self.loop_iterations += 1
        busy = self._run_ops()
        self._worker.progress()
        busy |= self._reap()
        busy |= self._probe()
        now = time.monotonic()
        if now - self._housekept >= _HOUSEKEEPING_S:
            self._housekept = now
            self._report_stalls(now)
            self._give_up_inbound(now)
            self._prune_abandoned()
            self._sweep()
        if busy or any(now - p.posted < _FRESH_S for p in self._pending):  # transfers in flight: full speed
            self._last_activity, self._idle_sleep = now, _IDLE_SLEEP_MIN_S
            time.sleep(0)
        elif now - self._last_activity > _IDLE_SPIN_S and not self._ops:
            if self._wake_fd is not None:
                self._worker.progress_worker_event(_PENDING_EVENT_WAIT_MS if self._pending else _EVENT_WAIT_MS)
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)  # level-triggered: drain it, or epoll returns at once
            else:  # idle: back off so a quiet transport costs little CPU on a busy host
                time.sleep(self._idle_sleep)
                self._idle_sleep = min(2 * self._idle_sleep, _IDLE_SLEEP_MAX_S)
        else:
            # Hand the GIL over: otherwise a thread woken by a completion waits for the interpreter's
            # switch interval (5 ms) while this loop spins.
            time.sleep(0)

    def _report_stalls(self, now: float) -> None:
        """Log requests outstanding past ``_STALL_REPORT_S``, once each, by peer (sends) or as receives."""
        stalled = [p for p in self._pending if not p.reported and now - p.posted > _STALL_REPORT_S]
        if not stalled:
            return
        by_peer: dict[str, list[_Pending]] = collections.defaultdict(list)
        for p in stalled:
            p.reported = True
            by_peer[p.peer or "(receives)"].append(p)
        groups = [
            f"{peer}: {len(ps)} ({sum(p.nbytes for p in ps)} bytes, oldest {now - min(p.posted for p in ps):.1f} s)"
            for peer, ps in sorted(by_peer.items())
        ]
        log.warning(
            "UCX requests outstanding for over %.0f s: %s (%d outstanding in all)",
            _STALL_REPORT_S,
            ", ".join(groups),
            len(self._pending),
        )

    def _give_up_inbound(self, now: float) -> None:
        """Drop the head of a sender's inbox still incomplete ``_INBOUND_GIVE_UP_S`` after its header was
        admitted, so that sender's later messages are delivered (see ``_INBOUND_GIVE_UP_S``)."""
        for sender, inbox in list(self._inbox.items()):
            head = inbox[0]
            if not (head.ready or head.dropped) and now - head.since > _INBOUND_GIVE_UP_S:
                log.warning("gave up a message from sender %07x incomplete after %.0f s (%d payload bytes); %d "
                            "behind it flow again", sender, now - head.since, head.held, len(inbox) - 1)  # fmt: skip
                self._strand(head)
                self._settle(sender, head, dropped=True)

    def _strand(self, slot: _Inbound) -> None:
        """Take ``slot``'s posted payload receive off the outstanding requests and release its buffer's pages;
        the buffer stays referenced in ``_stranded``, since UCX may still write into it."""
        receive = slot.receive
        if receive is None or not any(p is receive for p in self._pending):
            return
        self._pending = [p for p in self._pending if p is not receive]
        for buffer in receive.keepalive:
            release_pages(buffer)
        self._stranded.append(receive)

    def _prune_abandoned(self) -> None:
        """Let go of what UCX has finished with: stranded receives it completed after all, forgotten peers'
        sends it settled, and a forgotten peer's endpoint once its close completed and no send is left."""
        self._stranded = [p for p in self._stranded if not p.request.completed]
        kept = []
        for entry in self._abandoned:
            entry.sends = [p for p in entry.sends if not p.request.completed]
            closed = entry.endpoint is None or (entry.closing is not None and entry.closing.completed)
            if entry.sends or not closed:
                kept.append(entry)
        self._abandoned = kept

    def _run_ops(self) -> bool:
        ran = False
        while self._ops:
            op, handle = self._ops.popleft()
            ran = True
            try:
                op()
            except Exception as exc:  # an op that cannot even be posted fails only its own caller
                handle.set_done(exc if isinstance(exc, PeerError) else PeerError(f"UCX operation failed: {exc}"))
        return ran

    def _reap(self) -> bool:
        finished = [p for p in self._pending if p.request.completed]
        if not finished:
            return False
        self._pending = [p for p in self._pending if not p.request.completed]
        for p in finished:
            try:
                p.request.check_error()
                p.on_done(None)
            except Exception as exc:
                p.on_done(PeerError(f"UCX request failed: {exc}"))
        return True

    def _probe(self) -> bool:
        found = False
        mask = self._api.UCXXTagMask(_KIND_MASK)
        for kind in (KIND_HEADER, KIND_HELLO):
            probe = self._worker.tag_probe(self._api.UCXXTag(kind << 60), mask, remove=True)
            if probe.matched:
                found = True
                self._receive_probed(kind, probe)
        if self._probes_seen < self._probes_sent:
            if self._prober is not None:  # a transport with connections to set up (TCP) needs the prober's progress
                self._prober[0].progress()
            probe = self._worker.tag_probe(self._api.UCXXTag(KIND_PROBE << 60), mask, remove=True)
            if probe.matched:
                found = True
                self._probes_seen = max(self._probes_seen, probe.sender_tag.value & 0xFFFFFFFF)
                self._discard(probe)
        still: list[tuple[int, int, _Inbound]] = []
        now = time.monotonic()
        for sender, seq, slot in self._awaiting_payload:
            probe = self._worker.tag_probe(self._api.UCXXTag(make_tag(KIND_PAYLOAD, sender, seq)), remove=True)
            if not probe.matched:
                if now - slot.since > _PAYLOAD_WAIT_S:  # its sender died between header and payload
                    log.warning("dropped a message whose payload did not follow its header")
                    self._refuse(sender, seq)
                    self._settle(sender, slot, dropped=True)
                else:
                    still.append((sender, seq, slot))
                continue
            found = True
            assert slot.admitted is not None
            if probe.length != slot.admitted.nbytes:  # not the payload its authenticated header declared
                log.warning(
                    "dropped a payload of %d bytes whose header declared %d", probe.length, slot.admitted.nbytes
                )
                self._discard(probe)
                self._settle(sender, slot, dropped=True)
                continue
            payload = np.empty(slot.admitted.nbytes, np.uint8)
            request = self._worker.tag_recv_with_handle(self._Array(payload), probe)
            done = self._payload_done(sender, slot, payload)
            slot.receive = _Pending(request, done, (payload,), nbytes=payload.nbytes)
            slot.held = payload.nbytes
            self.held_bytes += payload.nbytes
            self._pending.append(slot.receive)
        self._awaiting_payload = still
        found |= self._discard_refused_payloads()
        return found

    def _sweep(self) -> None:
        """Discard what sits in UCX's unexpected queue that nothing will ever receive, so a peer cannot make it
        grow for good: messages of kinds no sender of ours uses, chunks when this transport takes none,
        receive-path probes when none is awaited, and payloads that no header claims. Headers are taken in
        first: a payload arrives after its header, so once none is left every unclaimed payload is a stray
        (its header was refused and forgotten, or never sent)."""
        kinds = list(_UNUSED_KINDS)
        if not self.chunks:
            kinds.append(KIND_CHUNK)
        if self._probes_seen >= self._probes_sent:
            kinds.append(KIND_PROBE)
        mask, swept = self._api.UCXXTagMask(_KIND_MASK), 0

        def first(kind: int, remove: bool = True) -> Any:
            return self._worker.tag_probe(self._api.UCXXTag(kind << 60), mask, remove=remove)

        for kind in kinds:
            while swept < _SWEEP_LIMIT and (probe := first(kind)).matched:
                self._discard(probe)
                swept += 1
        for _ in range(_SWEEP_LIMIT):
            if not (probe := first(KIND_HEADER)).matched:
                break
            self._receive_probed(KIND_HEADER, probe)
        claimed = (
            self._admitting | {(s, n) for s, n, _ in self._awaiting_payload} | {(s, n) for s, n, _ in self._refused}
        )
        while swept < _SWEEP_LIMIT and (probe := first(KIND_PAYLOAD, remove=False)).matched:
            tag = probe.sender_tag.value
            if ((tag >> 32) & 0x0FFFFFFF, tag & 0xFFFFFFFF) in claimed:
                break  # received in its turn; strays behind it are swept next time
            stray = self._worker.tag_probe(self._api.UCXXTag(tag), remove=True)  # the one just seen
            if not stray.matched:
                break
            self._discard(stray)
            swept += 1
        if swept:
            self.swept += swept
            log.warning("discarded %d stray messages from UCX's unexpected queue (%d so far)", swept, self.swept)

    def _refuse(self, sender: int, seq: int) -> None:
        """Remember a refused header, so the payload that follows it is discarded unread."""
        self._refused.append((sender, seq, time.monotonic() + _REFUSED_TTL_S))

    def _discard_refused_payloads(self) -> bool:
        """Drop the payloads that follow refused headers, so UCX does not hold them forever."""
        now = time.monotonic()
        while self._refused and self._refused[0][2] < now:
            self._refused.popleft()
        found = False
        for entry in list(self._refused):
            sender, seq, _expiry = entry
            probe = self._worker.tag_probe(self._api.UCXXTag(make_tag(KIND_PAYLOAD, sender, seq)), remove=True)
            if probe.matched:
                found = True
                self._refused.remove(entry)
                self._discard(probe)
        return found

    def _discard(self, probe: Any) -> None:
        """Receive a probed message into one byte: UCX truncates it (and a rendezvous is never pulled)."""
        sink = np.empty(1, np.uint8)
        request = self._worker.tag_recv_with_handle(self._Array(sink), probe)
        self._pending.append(_Pending(request, lambda _error: None, (sink,)))

    def _receive_probed(self, kind: int, probe: Any) -> None:
        limit = 1 if kind == KIND_HELLO else MAX_HEADER_BYTES
        if probe.length > limit:
            log.warning("dropped a %d-byte message posing as a header or hello (limit %d)", probe.length, limit)
            self._discard(probe)
            if kind == KIND_HEADER:  # a payload may follow it
                self._refuse((probe.sender_tag.value >> 32) & 0x0FFFFFFF, probe.sender_tag.value & 0xFFFFFFFF)
            return
        buf = np.empty(max(probe.length, 1), np.uint8)[: probe.length]
        tag = probe.sender_tag.value
        sender, seq = (tag >> 32) & 0x0FFFFFFF, tag & 0xFFFFFFFF
        slot = None
        if kind != KIND_HELLO:  # its place in the sender's order is taken now, in the order headers arrive
            slot = _Inbound()
            self._inbox.setdefault(sender, collections.deque()).append(slot)
            self._admitting.add((sender, seq))
        request = self._worker.tag_recv_with_handle(self._Array(buf), probe)

        def on_done(error: BaseException | None) -> None:
            if slot is None:
                return
            self._admitting.discard((sender, seq))
            if error is not None or self._admit is None:
                self._settle(sender, slot, dropped=True)
                return
            admitted = self._admit(buf.tobytes())
            if admitted is None:
                self._refuse(sender, seq)  # a payload may follow it
                self._settle(sender, slot, dropped=True)
            elif admitted.nbytes == 0:
                slot.admitted, slot.payload = admitted, np.empty(0, np.uint8)
                self._settle(sender, slot, dropped=False)
            else:
                slot.admitted, slot.since = admitted, time.monotonic()
                self._awaiting_payload.append((sender, seq, slot))

        self._pending.append(_Pending(request, on_done, (buf,)))

    def _payload_done(self, sender: int, slot: _Inbound, payload: np.ndarray) -> Callable[[BaseException | None], None]:
        def done(error: BaseException | None) -> None:
            slot.payload = payload
            self._settle(sender, slot, dropped=error is not None)

        return done

    def _settle(self, sender: int, slot: _Inbound, dropped: bool) -> None:
        """``slot`` is complete (or dropped): deliver the sender's messages that are now in order."""
        slot.ready, slot.dropped = not dropped, dropped
        if dropped:
            self._unhold(slot)
            slot.payload = None
            if slot.admitted is not None and self._drop is not None:
                self._drop(slot.admitted)
        inbox = self._inbox.get(sender)
        while inbox and (inbox[0].ready or inbox[0].dropped):
            head = inbox.popleft()
            if head.ready:
                assert head.admitted is not None and head.payload is not None
                self._unhold(head)
                if self._sink is not None:
                    self._sink(head.admitted, head.payload)
        if inbox is not None and not inbox:
            del self._inbox[sender]

    def _unhold(self, slot: _Inbound) -> None:
        """``slot``'s payload buffer is no longer this transport's: out of ``held_bytes``."""
        self.held_bytes -= slot.held
        slot.held = 0
