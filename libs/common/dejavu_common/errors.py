"""The error taxonomy that drives retries, recovery and HTTP status codes.

- :class:`RetryableError`: try again later (overload, a peer being replaced); HTTP 503.
- :class:`ClientError`: the request itself is wrong; HTTP 4xx, never retried.
- :class:`FatalError`: this process cannot go on (bad configuration, lost its stage); it exits.
"""

from __future__ import annotations


class DejaVuError(Exception):
    """Root of DejaVu's own exceptions."""


class RetryableError(DejaVuError):
    pass


class ClientError(DejaVuError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class FatalError(DejaVuError):
    pass


class DeadlineExceeded(RetryableError):
    """A wait on a peer or on Redis ran past its deadline."""
