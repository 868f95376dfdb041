"""Per-pair data-plane keys: a message from A to B is sealed with a key only A and B can derive.

The deployment secret gates membership: every member holds it, so a key derived from it alone lets any
member seal a message as any other. Here each process makes an X25519 key pair at its start (never
stored or sent; a restarted worker has a new one) and publishes the public half (the serving layer puts
it in the worker's registry record, which only that worker's Redis user may write). The key of messages
from sender S to receiver R is

    HKDF-SHA256(ikm = X25519(S, R), salt = the deployment key,
                info = domain | sender id | S's public key | receiver id | R's public key)

so it needs one of the two private keys (a member that holds only the secret derives no pair key it is
not part of), the secret (a stolen private key alone is no membership), and it is bound to both ids and
both processes' public keys (a message sealed for one receiver, or for an earlier process of either side,
verifies nowhere else). Each direction has its own key.

Keys are derived once per peer process (:meth:`PeerKeys.learn`: one X25519 and two HKDF), and a message
costs a dictionary lookup. Headers name their sender's key by its id (:func:`key_id`); a receiver that
meets a sender it does not know, or a key id other than the one it holds for that sender (the sender
restarted), asks ``resolve`` for the sender's published key, at most once per ``refresh_s`` per sender,
so a stream of forged headers costs a bounded number of look-ups. A sender with no published key, or
whose messages do not verify under the pair's key, is refused with :class:`SenderError`.

Thread-safety: every method may be called from any thread; ``resolve`` runs without the lock held.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from dejavulib.errors import PeerError, SenderError
from dejavulib.header import KEY_ID_BYTES, Header, secret_key, sender_field

log = logging.getLogger(__name__)

_INFO = b"dejavu-pair-key\x00v1\x00"
PUBLIC_BYTES = 32
#: Least time between two look-ups of one sender's published key (a restarted peer is found at once).
REFRESH_S = 1.0

#: What ``resolve`` does: a header's sender field (:func:`sender_field`) to that sender's worker id and
#: published public key (raw bytes), or None where it publishes none. It may raise; the receiver then
#: refuses the message.
Resolve = Callable[[str], tuple[str, bytes] | None]


def key_id(public: bytes) -> bytes:
    """The id a header carries for the sender's public key ``public``."""
    return hashlib.blake2s(public, digest_size=KEY_ID_BYTES).digest()


def decode_public_key(encoded: str) -> bytes:
    """A published key (base64 of 32 raw bytes) as bytes; ``ValueError`` for anything else (empty too)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"data-plane key is not base64: {exc}") from exc
    if len(raw) != PUBLIC_BYTES:
        raise ValueError(f"data-plane key of {len(raw)} bytes, expected {PUBLIC_BYTES}")
    return raw


@dataclass(frozen=True)
class _Peer:
    """What this process holds for one peer process: its public key's id and the two pair keys."""

    peer_id: str
    key_id: bytes
    to_peer: bytes  # seals what this process sends it
    from_peer: bytes  # verifies what it sends this process


class PeerKeys:
    """This process's data-plane key pair and the pair keys of the peers it knows. See the module docstring."""

    def __init__(
        self,
        self_id: str,
        secret: str | bytes,
        resolve: Resolve | None = None,
        refresh_s: float = REFRESH_S,
        private_key: X25519PrivateKey | None = None,
    ) -> None:
        self.self_id = self_id
        self._private = private_key if private_key is not None else X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = key_id(self.public)
        self._salt = secret_key(secret)
        self.resolve = resolve
        self.refresh_s = refresh_s
        self._peers: dict[str, _Peer] = {}  # by sender field (what headers carry)
        self._looked_up: dict[str, float] = {}  # sender field -> monotonic time of its last look-up
        self._lock = threading.Lock()
        self.learn(self_id, self.public)  # a process may send to itself

    @property
    def public_key(self) -> str:
        """The public key to publish (base64), e.g. in ``WorkerInfo.data_key``."""
        return base64.b64encode(self.public).decode()

    def learn(self, peer_id: str, public: bytes) -> None:
        """Hold ``peer_id``'s published key ``public`` (raw): derive both pair keys, unless it is the key held
        already. Raises ``ValueError`` for a key that is not an X25519 public key."""
        if len(public) != PUBLIC_BYTES:
            raise ValueError(f"data-plane key of {len(public)} bytes, expected {PUBLIC_BYTES}")
        if "\x00" in peer_id:
            raise ValueError(f"a worker id with a NUL byte: {peer_id!r}")
        field, kid = sender_field(peer_id), key_id(public)
        with self._lock:
            held = self._peers.get(field)
            if held is not None and held.key_id == kid and held.peer_id == peer_id:
                return
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(public))
        peer = _Peer(
            peer_id=peer_id,
            key_id=kid,
            to_peer=self._derive(shared, self.self_id, self.public, peer_id, public),
            from_peer=self._derive(shared, peer_id, public, self.self_id, self.public),
        )
        with self._lock:
            self._peers[field] = peer

    def sending(self, peer_id: str) -> tuple[bytes, bytes]:
        """The key sealing what this process sends ``peer_id``, and this process's key id. Raises
        :class:`PeerError` for a peer whose key it was never given (:meth:`learn`)."""
        with self._lock:
            peer = self._peers.get(sender_field(peer_id))
        if peer is None or peer.peer_id != peer_id:
            raise PeerError(f"no data-plane key of peer {peer_id!r}: connect to it first")
        return peer.to_peer, self.key_id

    def receiving(self, header: Header) -> bytes:
        """The key ``header``'s sender seals its messages to this process with, looked up (``resolve``) when
        the sender or its key id is new here and the last look-up is ``refresh_s`` old. Raises
        :class:`SenderError` when there is none: the sender publishes no key, or not this one."""
        with self._lock:
            peer = self._peers.get(header.sender)
        if peer is not None and peer.key_id == header.key_id:
            return peer.from_peer
        self._look_up(header.sender)
        with self._lock:
            peer = self._peers.get(header.sender)
        if peer is None:
            raise SenderError(f"sender {header.sender!r} publishes no data-plane key")
        if peer.key_id != header.key_id:
            raise SenderError(
                f"sender {header.sender!r} sealed with key {header.key_id.hex()}, not its published "
                f"{peer.key_id.hex()} (an earlier process of it, or a forgery)"
            )
        return peer.from_peer

    def _look_up(self, field: str) -> None:
        """Learn ``field``'s published key through ``resolve``, unless it was looked up in the last
        ``refresh_s``; a sender that publishes no key any more is forgotten. Never raises."""
        now = time.monotonic()
        with self._lock:
            last = self._looked_up.get(field)
            if self.resolve is None or (last is not None and now - last < self.refresh_s):
                return
            self._looked_up[field] = now
            if len(self._looked_up) > 4 * len(self._peers) + 1024:  # forged names: keep only recent ones
                cutoff = now - self.refresh_s
                self._looked_up = {k: t for k, t in self._looked_up.items() if t >= cutoff}
        try:
            found = self.resolve(field)
            if found is not None and sender_field(found[0]) != field:
                raise ValueError(f"resolved to worker {found[0]!r}, which is not sender {field!r}")
        except Exception as exc:  # the receiver refuses the message and keeps serving
            log.warning("could not look up the data-plane key of %r: %s", field, exc)
            return
        if found is None:
            with self._lock:
                self._peers.pop(field, None)
            return
        try:
            self.learn(*found)
        except ValueError as exc:
            log.warning("the data-plane key %r publishes is unusable: %s", field, exc)

    def _derive(self, shared: bytes, sender: str, sender_public: bytes, receiver: str, receiver_public: bytes) -> bytes:
        """The key of messages from ``sender`` to ``receiver`` (see the module docstring)."""
        info = b"".join((_INFO, sender.encode(), b"\x00", sender_public, receiver.encode(), b"\x00", receiver_public))
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=self._salt, info=info).derive(shared)
