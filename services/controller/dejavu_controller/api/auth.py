"""Bearer API keys: who may call the API, and whether the API may be exposed at all.

Only ``/health`` and ``/ready`` stay open (orchestrators probe them); every other path requires
``Authorization: Bearer <key>`` with one of ``controller.api_keys`` (:mod:`.guard` applies it before
the body is read). Keys are compared in constant time, against every configured key, so timing
reveals neither a key's prefix nor which key matched.

Logs, metrics and settings name a key by its *key id* (:func:`key_id`), never by the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence

from pydantic import SecretStr

from dejavu_common.exposure import is_loopback

from .errors import UnauthorizedError

__all__ = ["ANONYMOUS", "ApiKeyVerifier", "InsecureExposureError", "is_loopback", "key_id"]

log = logging.getLogger(__name__)

#: The key id of every request when no API keys are configured.
ANONYMOUS = "anonymous"
_KEY_ID_HEX = 12


def key_id(key: str) -> str:
    """The non-secret name of an API key: the first 12 hex digits of its SHA-256 (48 bits: enough to tell
    a deployment's keys apart, nothing to recover a key from)."""
    return hashlib.sha256(key.encode()).hexdigest()[:_KEY_ID_HEX]


class InsecureExposureError(ValueError):
    """The API would listen beyond loopback without any API key."""


class ApiKeyVerifier:
    """Checks bearer tokens against the configured keys; with no keys, lets everything through."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        self._keys = tuple(key.get_secret_value().encode() for key in keys)
        self._ids = tuple(key_id(key.get_secret_value()) for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The ids of the configured keys, in their order (``(ANONYMOUS,)`` without keys)."""
        return self._ids if self.enabled else (ANONYMOUS,)

    def check_exposure(self, host: str) -> None:
        """Refuse (raise :class:`InsecureExposureError`) a keyless API on a non-loopback ``host``;
        warn about a keyless one on loopback."""
        if self.enabled:
            return
        if not is_loopback(host):
            raise InsecureExposureError(
                f"refusing to serve an unauthenticated API on {host!r}: set DEJAVU_CONTROLLER__API_KEYS "
                "(e.g. '[\"sk-...\"]') or bind to 127.0.0.1"
            )
        log.warning("no API keys configured: the API on %s is unauthenticated (loopback only)", host)

    def verify(self, token: str | None) -> None:
        """Accept a bearer ``token`` or raise :class:`UnauthorizedError` (HTTP 401)."""
        self.identify(token)

    def identify(self, token: str | None) -> str:
        """The key id of a bearer ``token`` (:data:`ANONYMOUS` without keys), or raise
        :class:`UnauthorizedError` (HTTP 401) if it is none of the configured keys."""
        if not self.enabled:
            return ANONYMOUS
        if not token:
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        presented = token.encode()
        matched: str | None = None
        for key, id_ in zip(self._keys, self._ids, strict=True):  # no early exit: every key is compared
            if hmac.compare_digest(presented, key):
                matched = id_
        if matched is None:
            raise UnauthorizedError("incorrect API key provided")
        return matched
