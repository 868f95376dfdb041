"""Signed worker entries in Redis: who wrote a token-stream entry, and that nobody else did.

Every worker's Redis user may append to any token stream (``dejavu:tok:*``): the last stage of whichever
pipeline serves a microbatch writes it. So Redis cannot tell the controller which worker wrote an entry;
a signature can. Each worker process holds an Ed25519 key of its own, made at its start and never stored
or sent (:class:`EntrySigner`); its public half rides in the worker's registry record
(``WorkerInfo.entry_key``), which only that worker's Redis user may write (``infra/redis/users.acl.rules``).
A worker signs each entry it writes (the entry's Redis key, what it says and the writer's id, so no
signature is valid for another stream, another writer or other content), and the controller accepts an
entry only from a worker the topology names for a stage that writes such entries, under that worker's key
(:func:`verify_entry`). A compromised worker can then sign only as itself: it cannot put text into a
stream as another worker, and a worker outside the pipelines (a spare, a worker fenced off) cannot write
into any client's answer at all.

Entries keep their payload field as it is (``step``: a ``TokenStep``) and add two: ``by`` (the writer's
worker id) and ``sig`` (base64 of the signature). A string value (a token stage's progress report at a new
epoch, which decides where each microbatch resumes) is sealed the same way (:func:`seal`): JSON of the
payload, the writer and the signature. A replication watermark stays a plain integer in its hash, and
its signature goes to the same field of a hash beside it (:func:`sign_watermark`).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

_DOMAIN = b"dejavu-entry\x00v1\x00"
WRITER, SIGNATURE = "by", "sig"  # the fields a signed entry adds


class UnverifiedEntry(ValueError):
    """An entry without a valid signature of a writer the reader accepts."""


def _message(redis_key: str, writer: str, payload: bytes) -> bytes:
    """What is signed: the domain, the entry's Redis key and writer (each NUL-terminated: neither holds a
    NUL), then the payload."""
    if "\x00" in redis_key or "\x00" in writer:
        raise ValueError("a Redis key or worker id with a NUL byte")
    return b"".join((_DOMAIN, redis_key.encode(), b"\x00", writer.encode(), b"\x00", payload))


class EntrySigner:
    """A worker's entry-signing key (Ed25519): fresh per process, so a restarted worker has a new one."""

    def __init__(self, worker_id: str, key: Ed25519PrivateKey | None = None) -> None:
        self.worker_id = worker_id
        self._key = key if key is not None else Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_key = base64.b64encode(raw).decode()  # what ``WorkerInfo.entry_key`` carries

    def sign(self, redis_key: str, payload: bytes) -> dict[str, bytes]:
        """The fields that sign ``payload`` as an entry of ``redis_key`` written by this worker."""
        signature = self._key.sign(_message(redis_key, self.worker_id, payload))
        return {WRITER: self.worker_id.encode(), SIGNATURE: base64.b64encode(signature)}

    def entry(self, redis_key: str, field: str, payload: bytes) -> dict[str, bytes]:
        """A stream entry: ``payload`` under ``field``, signed (:meth:`sign`)."""
        return {field: payload, **self.sign(redis_key, payload)}


def token_entry(signer: EntrySigner | None, redis_key: str, step: bytes) -> dict[str, bytes]:
    """A token-stream entry of ``step`` (an encoded ``TokenStep``), signed by ``signer``. None: unsigned,
    which only a reader of the raw stream takes (the controller refuses it); serving workers always sign."""
    return {"step": step} if signer is None else signer.entry(redis_key, "step", step)


def seal(signer: EntrySigner, redis_key: str, payload: bytes) -> bytes:
    """``payload`` signed as the value of string key ``redis_key`` (a stage's progress report): JSON of the
    payload (utf-8 text), the writer and the signature; :func:`unseal` reads it."""
    signed = signer.sign(redis_key, payload)
    return json.dumps({"payload": payload.decode(), **{k: v.decode() for k, v in signed.items()}}).encode()


def unseal(redis_key: str, raw: bytes, keys_of: Mapping[str, tuple[Ed25519PublicKey, ...]]) -> tuple[str, bytes]:
    """The writer and payload of a value :func:`seal` made, verified as :func:`verify_entry` does; raises
    :class:`UnverifiedEntry` for anything else."""
    try:
        sealed = json.loads(raw)
        fields = {k.encode(): sealed[k].encode() for k in ("payload", WRITER, SIGNATURE)}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UnverifiedEntry(f"not a sealed value ({type(exc).__name__}: {exc})") from exc
    return verify_entry(redis_key, fields, "payload", keys_of)


def watermark_field(redis_key: str, mb_id: int | bytes | str) -> str:
    """What a watermark's signature is for: the hash ``redis_key`` and its field ``mb_id``."""
    return f"{redis_key}/{mb_id.decode() if isinstance(mb_id, bytes) else mb_id}"


def sign_watermark(signer: EntrySigner, redis_key: str, mb_id: int, step: int) -> bytes:
    """The value of ``mb_id``'s field in the signature hash beside watermark hash ``redis_key``: the writer
    and the signature of ``step`` for that field (watermarks stay plain integers: every reader keeps them)."""
    signed = signer.sign(watermark_field(redis_key, mb_id), str(step).encode())
    return signed[WRITER] + b" " + signed[SIGNATURE]


def verify_watermark(
    redis_key: str,
    mb_id: bytes,
    step: bytes,
    signature: bytes | None,
    keys_of: Mapping[str, tuple[Ed25519PublicKey, ...]],
) -> int:
    """The watermark ``step`` of field ``mb_id`` once ``signature`` (:func:`sign_watermark`) verifies under
    ``keys_of``; :class:`UnverifiedEntry` otherwise (a missing signature included)."""
    if signature is None:
        raise UnverifiedEntry(f"watermark {watermark_field(redis_key, mb_id)} is not signed")
    writer, _, sig = signature.partition(b" ")
    fields = {b"step": step, WRITER.encode(): writer, SIGNATURE.encode(): sig}
    _, payload = verify_entry(watermark_field(redis_key, mb_id), fields, "step", keys_of)
    return int(payload)


def public_key(encoded: str) -> Ed25519PublicKey:
    """An ``entry_key`` as a key; ``ValueError`` unless it is base64 of 32 bytes."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"entry key is not base64: {exc}") from exc
    if len(raw) != 32:
        raise ValueError(f"entry key of {len(raw)} bytes, expected 32")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify_entry(
    redis_key: str,
    fields: Mapping[bytes, bytes],
    payload_field: str,
    keys_of: Mapping[str, tuple[Ed25519PublicKey, ...]],
) -> tuple[str, bytes]:
    """The writer and payload of a signed entry of ``redis_key``, once its signature verifies under a key of
    its writer in ``keys_of`` (the workers the reader accepts as writers of such entries, each with the keys
    of its recent process instances). Raises :class:`UnverifiedEntry` otherwise: a field missing, a writer
    the reader does not accept, or a signature that is not the writer's."""
    try:
        payload = fields[payload_field.encode()]
        writer = fields[WRITER.encode()].decode()
        signature = base64.b64decode(fields[SIGNATURE.encode()], validate=True)
    except (KeyError, UnicodeDecodeError, binascii.Error) as exc:
        raise UnverifiedEntry(f"not a signed entry ({type(exc).__name__}: {exc})") from exc
    candidates = keys_of.get(writer)
    if not candidates:
        raise UnverifiedEntry(f"written by {writer!r}, which may not write {redis_key}")
    try:
        message = _message(redis_key, writer, payload)
    except ValueError as exc:
        raise UnverifiedEntry(str(exc)) from exc
    for key in candidates:
        try:
            key.verify(signature, message)
            return writer, payload
        except InvalidSignature:
            continue
    raise UnverifiedEntry(f"signature of {writer!r} on {redis_key} does not verify: forged, or not its key")
