"""Admin commands: signing and verification with the admin credential (HMAC-SHA256).

Workers execute an :class:`AdminCommand` only if its MAC verifies with the credential from their
settings, so a client that can write to Redis but lacks the credential cannot kill or pause workers.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

from dejavu_common.messages import AdminAction, AdminCommand


def _payload(command_id: str, worker_id: str, action: AdminAction, seconds: float) -> bytes:
    return f"{command_id}|{worker_id}|{action.value}|{seconds:.6f}".encode()


def sign(worker_id: str, action: AdminAction, credential: str, seconds: float = 0.0) -> AdminCommand:
    command_id = uuid.uuid4().hex
    mac = hmac.new(credential.encode(), _payload(command_id, worker_id, action, seconds), hashlib.sha256).hexdigest()
    return AdminCommand(command_id=command_id, worker_id=worker_id, action=action, seconds=seconds, mac=mac)


def verify(command: AdminCommand, credential: str) -> bool:
    expected = hmac.new(
        credential.encode(),
        _payload(command.command_id, command.worker_id, command.action, command.seconds),
        hashlib.sha256,
    ).hexdigest()
    return hmac.compare_digest(expected, command.mac)
