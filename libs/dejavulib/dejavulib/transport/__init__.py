"""Transports: one interface (base.py); UCX between worker processes, disk for replicas kept on disk,
local (host/device copies in one process) and fake (tests' in-process peers)."""

from dejavulib.transport.base import MessageTransport, Transport

__all__ = ["MessageTransport", "Transport"]
