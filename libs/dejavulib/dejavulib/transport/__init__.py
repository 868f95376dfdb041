"""Transports: one interface (base.py); UCX between worker processes, disk for replicas kept on disk
(the tests' in-process fake is ``tests/dejavulib/fake_transport.py``)."""

from dejavulib.transport.base import MessageTransport, Transport

__all__ = ["MessageTransport", "Transport"]
