"""The fixed binary header every DejaVuLib message carries, and its seal (three MACs).

Layout (little endian, ``Header.SIZE`` bytes): magic, version, channel, dtype code, flags (which K/V),
ndim, dims[4], microbatch, step, layers, rows, positions, user, payload byte count, payload MAC
(16 bytes), sender epoch, sequence number, sender id (32 bytes, utf-8, NUL padded), the sender's key id
(8 bytes), then two 16-byte HMAC-SHA256 of all the bytes before them: the *member* MAC, keyed by the
per-deployment secret, and the *sender* MAC, keyed by the key of the (sender, receiver) pair
(:mod:`dejavulib.peerkeys`; an endpoint without per-pair keys uses the deployment key for both).

The payload MAC is HMAC-SHA256 (truncated to 16 bytes) of the payload under the pair's key, and the
header MACs cover it, so together they authenticate header + payload: changing a payload byte needs
the key, unlike a checksum, which an on-path attacker can recompute. The header is checked on its own
first (:meth:`Header.unpack`): the member MAC before anything else (a sender outside the deployment
makes the receiver look nothing up), then the sender MAC under the key of the sender it names, so a
receiver sizes no payload buffer for an unauthenticated sender; the payload is checked
(:meth:`Header.verify_payload`) before any of its bytes is interpreted. No pickle: ``pack``/``unpack``
are ``struct`` only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from dejavulib.errors import IntegrityError, SenderError

MAGIC = 0x554A5644  # b"DVJU" little endian
# 2: a payload MAC instead of a crc32; 3: 64-bit microbatch ids (a controller incarnation is their top);
# 4: the sender's key id and a sender MAC under the pair's key
VERSION = 4
SENDER_BYTES = 32
KEY_ID_BYTES = 8
NO_KEY_ID = bytes(KEY_ID_BYTES)  # what an endpoint without per-pair keys sends


def sender_field(peer_id: str) -> str:
    """The id a header carries for ``peer_id``: itself when it fits in ``SENDER_BYTES`` utf-8 bytes,
    else its head and a digest of the whole (ids are hostnames in deployments, and may be long)."""
    raw = peer_id.encode()
    if len(raw) <= SENDER_BYTES:
        return peer_id
    digest = hashlib.blake2s(raw, digest_size=4).hexdigest()
    head = raw[: SENDER_BYTES - len(digest) - 1].decode(errors="ignore")  # never half a character
    return f"{head}~{digest}"


MAC_BYTES = 16
_BODY = struct.Struct(f"<IHBBBB4IQIHHHHIIQQ{MAC_BYTES}sQQ{SENDER_BYTES}s{KEY_ID_BYTES}s")
_PAYLOAD_DOMAIN = b"dejavu-payload\x00"  # a payload MAC is never a valid header MAC, and back


class Channel(enum.IntEnum):
    """Per-channel receive queues; different threads wait on different channels."""

    KV_PROMPT = 1
    KV_REPLICA = 2
    ACTIVATION = 3
    TOKENS = 4
    CONTROL = 5
    KV_SWAP = 6
    KV_RESTORE = 7  # recovery: caches sent to a replacement stage


class DType(enum.IntEnum):
    """Payload element types (codes on the wire)."""

    UINT8 = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT64 = 4
    INT32 = 5

    @property
    def itemsize(self) -> int:
        return {0: 1, 1: 4, 2: 2, 3: 2, 4: 8, 5: 4}[int(self)]

    @classmethod
    def from_name(cls, name: str) -> DType:
        """From a torch/numpy dtype name such as ``'float32'`` or ``'torch.int64'``."""
        return cls[name.removeprefix("torch.").upper()]


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]


def payload_mac(key: bytes, data: memoryview | bytes) -> bytes:
    """The payload's MAC under ``key`` (hashlib releases the GIL while it hashes a large payload)."""
    mac = hmac.new(key, _PAYLOAD_DOMAIN, hashlib.sha256)
    mac.update(data)
    return mac.digest()[:MAC_BYTES]


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key derived from a deployment secret (the secret itself never travels)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(b"dejavu-data-plane\x00" + raw).digest()


@dataclass(frozen=True)
class Header:
    """What a payload is. Fields a sender leaves at defaults are filled by ``Endpoint.send``."""

    channel: Channel
    dtype: DType = DType.UINT8
    shape: tuple[int, ...] = ()
    which: int = 0
    microbatch: int = 0
    step: int = 0
    layers: tuple[int, int] = (0, 0)
    rows: tuple[int, int] = (0, 0)
    positions: tuple[int, int] = (0, 0)
    user: int = 0
    nbytes: int = 0
    mac: bytes = bytes(MAC_BYTES)  # the payload's
    epoch: int = 0
    seq: int = 0
    sender: str = ""
    key_id: bytes = NO_KEY_ID  # of the sender's data-plane key (``PeerKeys.key_id``)

    SIZE = _BODY.size + 2 * MAC_BYTES

    def __post_init__(self) -> None:
        if len(self.shape) > 4:
            raise ValueError("a header carries at most 4 dims")
        if len(self.sender.encode()) > SENDER_BYTES:
            raise ValueError(f"sender id longer than {SENDER_BYTES} bytes: {self.sender!r}")
        if len(self.key_id) != KEY_ID_BYTES:
            raise ValueError(f"a key id is {KEY_ID_BYTES} bytes, not {len(self.key_id)}")

    def with_payload(
        self, payload: memoryview, key: bytes, *, epoch: int, seq: int, sender: str, key_id: bytes = NO_KEY_ID
    ) -> Header:
        """This header completed for ``payload``: size, payload MAC under ``key`` (the pair's), epoch,
        sequence, sender and the sender's key id."""
        mac = payload_mac(key, payload)
        return replace(self, nbytes=payload.nbytes, mac=mac, epoch=epoch, seq=seq, sender=sender, key_id=key_id)

    def pack(self, key: bytes, sender_key: bytes | None = None) -> bytes:
        """Serialize and seal: the member MAC with ``key`` (from :func:`secret_key`), the sender MAC with
        ``sender_key`` (the pair's key; None: ``key``)."""
        dims = (*self.shape, *([0] * (4 - len(self.shape))))
        body = _BODY.pack(
            MAGIC, VERSION, int(self.channel), int(self.dtype), self.which, len(self.shape), *dims,
            self.microbatch, self.step, *self.layers, *self.rows, *self.positions, self.user,
            self.nbytes, self.mac, self.epoch, self.seq, self.sender.encode(), self.key_id,
        )  # fmt: skip
        return body + _mac(key, body) + _mac(key if sender_key is None else sender_key, body)

    @classmethod
    def unpack(cls, raw: bytes | memoryview, key: bytes, sender_key: Callable[[Header], bytes] | None = None) -> Header:
        """Parse and authenticate; raises ``IntegrityError`` on bad magic/version/size/MAC or unknown codes.

        The member MAC is checked with ``key`` first; then the sender MAC with ``sender_key(header)``, the
        key of the pair whose sender the header names (None: ``key``), which raises ``SenderError`` itself
        for a sender whose key it does not know; a sender MAC that fails raises ``SenderError`` too."""
        raw = bytes(raw)
        if len(raw) != cls.SIZE:
            raise IntegrityError(f"header of {len(raw)} bytes, expected {cls.SIZE}")
        body, member, seal = raw[: _BODY.size], raw[_BODY.size : -MAC_BYTES], raw[-MAC_BYTES:]
        if not hmac.compare_digest(member, _mac(key, body)):
            raise IntegrityError("header MAC mismatch (wrong deployment secret or corrupted header)")
        f = _BODY.unpack(body)
        if f[0] != MAGIC or f[1] != VERSION:
            raise IntegrityError(f"bad magic/version {f[0]:#x}/{f[1]}")
        try:
            channel, dtype = Channel(f[2]), DType(f[3])
        except ValueError as exc:
            raise IntegrityError(str(exc)) from exc
        ndim = f[5]
        header = cls(
            channel=channel, dtype=dtype, which=f[4], shape=tuple(f[6 : 6 + ndim]), microbatch=f[10], step=f[11],
            layers=(f[12], f[13]), rows=(f[14], f[15]), positions=(f[16], f[17]), user=f[18], nbytes=f[19],
            mac=f[20], epoch=f[21], seq=f[22], sender=f[23].rstrip(b"\x00").decode(errors="replace"), key_id=f[24],
        )  # fmt: skip
        pair = key if sender_key is None else sender_key(header)
        if not hmac.compare_digest(seal, _mac(pair, body)):
            raise SenderError(
                f"sender MAC mismatch: the message is not from {header.sender!r} (forged, or sealed for another "
                "receiver or an earlier instance of either)"
            )
        return header

    def verify_payload(self, payload: memoryview, key: bytes) -> None:
        """Raise ``IntegrityError`` unless ``payload`` has this header's size and its MAC under ``key``."""
        if payload.nbytes != self.nbytes:
            raise IntegrityError(f"payload of {payload.nbytes} bytes, header says {self.nbytes}")
        if not hmac.compare_digest(payload_mac(key, payload), self.mac):
            raise IntegrityError(f"payload MAC mismatch (seq {self.seq} from {self.sender!r}): forged or corrupted")
