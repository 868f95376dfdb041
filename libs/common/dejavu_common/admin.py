"""Admin commands: Ed25519-signed, expiring, single-use orders for one worker instance.

The admin tool signs with the deployment's private key (``admin.signing_key``); workers hold only the
public key (``admin.verify_key``), so a worker, or anyone who can read a worker's settings or write to
Redis, cannot forge a command. What a signature covers, and what a worker checks before it obeys:

* the target: worker id *and* instance (a restarted worker is a new instance, so an order for the
  previous process is void);
* the time window: ``issued_at`` .. ``expires_at`` (at most ``admin.command_ttl_s`` apart, with
  ``admin.clock_skew_s`` of tolerance between the admin host's clock and the worker's);
* the nonce (``command_id``, 128 random bits): a worker remembers every nonce it executed until the
  command expires, so a replayed command is refused; after expiry the window check refuses it;
* the action and its argument: ``pause-heartbeats`` seconds within ``admin.max_pause_s``.

Keys travel as base64 of their raw 32 bytes; :func:`generate_keypair` makes a pair.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import threading
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from dejavu_common.messages import AdminAction, AdminCommand

_DOMAIN = b"dejavu-admin-command-v1\x00"  # a signature over anything else never verifies as a command


class AdminKeyError(ValueError):
    """A configured admin key is not base64 of 32 bytes."""


class AdminRejected(Exception):
    """A command a worker must not execute; the message says why (logged, never executed)."""


def generate_keypair() -> tuple[str, str]:
    """A fresh ``(signing_key, verify_key)`` pair, each base64 of 32 raw bytes."""
    private = Ed25519PrivateKey.generate()
    raw_private = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    raw_public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw_private).decode(), base64.b64encode(raw_public).decode()


def _raw_key(encoded: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AdminKeyError(f"the admin {what} key is not base64") from exc
    if len(raw) != 32:
        raise AdminKeyError(f"the admin {what} key must be 32 bytes, got {len(raw)}")
    return raw


def signing_key(encoded: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_raw_key(encoded, "signing"))


def verify_key(encoded: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_raw_key(encoded, "verify"))


def signed_bytes(command: AdminCommand) -> bytes:
    """What the signature covers: every field but the signature, as canonical JSON."""
    fields = command.model_dump(mode="json", exclude={"signature"})
    return _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign(
    key: str,
    worker_id: str,
    instance: str,
    action: AdminAction,
    *,
    seconds: float = 0.0,
    ttl_s: float = 30.0,
    now: float | None = None,
) -> AdminCommand:
    """A command for ``worker_id``'s current ``instance``, valid for ``ttl_s`` from ``now`` (wall clock)."""
    issued = time.time() if now is None else now
    unsigned = AdminCommand(
        command_id=secrets.token_hex(16),
        worker_id=worker_id,
        instance=instance,
        action=action,
        seconds=seconds,
        issued_at=issued,
        expires_at=issued + ttl_s,
        signature="",
    )
    signature = signing_key(key).sign(signed_bytes(unsigned))
    return unsigned.model_copy(update={"signature": base64.b64encode(signature).decode()})


class CommandVerifier:
    """Decides whether one worker instance executes a command (see the module docstring).

    Thread-safe. ``key`` None (no verify key configured) refuses every command. Nonces are kept only
    for commands that verified, until they expire, so memory is bounded by the legitimate command rate.
    """

    def __init__(
        self,
        key: str | None,
        worker_id: str,
        instance: str,
        *,
        max_ttl_s: float,
        max_pause_s: float,
        clock_skew_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = verify_key(key) if key else None
        self.worker_id, self.instance = worker_id, instance
        self.max_ttl_s, self.max_pause_s, self.clock_skew_s = max_ttl_s, max_pause_s, clock_skew_s
        self._clock = clock
        self._seen: dict[str, float] = {}  # nonce -> expires_at
        self._lock = threading.Lock()

    def addressed_here(self, command: AdminCommand) -> bool:
        """Whether the command names this worker id (commands for others are skipped silently)."""
        return command.worker_id == self.worker_id

    def check(self, command: AdminCommand) -> None:
        """Return if this worker must execute ``command``; raise :class:`AdminRejected` otherwise.

        A command that passes is remembered: the same command (nonce) is refused from then on.
        """
        if self._key is None:
            raise AdminRejected("no admin verify key is configured: admin commands are disabled")
        try:
            self._key.verify(base64.b64decode(command.signature, validate=True), signed_bytes(command))
        except (InvalidSignature, binascii.Error, ValueError) as exc:
            raise AdminRejected("bad signature (not signed with the deployment's admin key)") from exc
        if command.worker_id != self.worker_id or command.instance != self.instance:
            raise AdminRejected(f"addressed to {command.worker_id}/{command.instance}, not to this instance")
        now = self._clock()
        with self._lock:  # a nonce is kept until its command could no longer pass the window check
            self._seen = {nonce: t for nonce, t in self._seen.items() if t + self.clock_skew_s >= now}
        if command.expires_at - command.issued_at > self.max_ttl_s:
            raise AdminRejected(f"valid for {command.expires_at - command.issued_at:.0f} s, more than allowed")
        if not command.issued_at - self.clock_skew_s <= now <= command.expires_at + self.clock_skew_s:
            raise AdminRejected("expired or not yet valid")
        if command.action is AdminAction.PAUSE_HEARTBEATS and not 0 < command.seconds <= self.max_pause_s:
            raise AdminRejected(f"pause of {command.seconds} s outside (0, {self.max_pause_s}]")
        with self._lock:
            if command.command_id in self._seen:
                raise AdminRejected("replayed (this command was already executed)")
            self._seen[command.command_id] = command.expires_at
