"""Bearer API keys: who may call the API, and whether the API may be exposed at all.

Only ``/health`` and ``/ready`` stay open (orchestrators probe them); every other path requires
``Authorization: Bearer <key>`` with one of ``controller.api_keys`` (:mod:`.guard` applies it before
the body is read). Keys are compared in constant time, against every configured key, so timing
reveals neither a key's prefix nor which key matched.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from pydantic import SecretStr

from dejavu_common.exposure import is_loopback

from .errors import UnauthorizedError

__all__ = ["ApiKeyVerifier", "InsecureExposureError", "is_loopback"]

log = logging.getLogger(__name__)


class InsecureExposureError(ValueError):
    """The API would listen beyond loopback without any API key."""


class ApiKeyVerifier:
    """Checks bearer tokens against the configured keys; with no keys, lets everything through."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        self._keys = tuple(key.get_secret_value().encode() for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

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
        if not self.enabled:
            return
        if not token:
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        presented = token.encode()
        matched = False
        for key in self._keys:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise UnauthorizedError("incorrect API key provided")
