"""The typed errors of DejaVuLib.

``DejaVuLibError`` is the root. Callers drive recovery from the class alone:

* ``TransferTimeout`` (retryable: the peer may be slow or dead; our deadlines are the only dead-peer
  detector because UCX endpoint error handling is off for shared-memory speed),
* ``PeerError`` (the peer is unknown, unreachable or its endpoint failed),
* ``IntegrityError`` (a payload does not match its header's MAC or size: never retry blindly;
  ``SenderError``: the message is not from the sender it names),
* ``TransportUnavailable`` (configuration asks for a transport this host cannot provide: fatal).
"""

from __future__ import annotations


class DejaVuLibError(Exception):
    """Root of every error this library raises on purpose."""


class TransferError(DejaVuLibError):
    """A transfer did not complete."""


class TransferTimeout(TransferError):
    """A transfer (or a wait for one) did not complete within its deadline."""


class BackPressureTimeout(TransferTimeout):
    """``Streamer.submit`` could not admit a transfer within its deadline: too many bytes in flight."""


class PeerError(TransferError):
    """The peer is not connected, unreachable, or its endpoint reported an error."""


class IntegrityError(DejaVuLibError):
    """A received payload does not match its header (MAC, size or dtype)."""


class SenderError(IntegrityError):
    """A message's sender cannot be authenticated: it publishes no data-plane key, or the message is not
    sealed with the key of the pair (the sender it names, this receiver)."""


class ProtocolError(DejaVuLibError):
    """A well-formed message arrived that the receiving primitive did not expect."""


class TransportUnavailable(DejaVuLibError):
    """A required transport (e.g. UCX shared memory) was not selected or cannot be created."""


class ClosedError(DejaVuLibError):
    """The transport, endpoint or streamer was closed."""
