"""Transports: one interface (base.py), implementations local, ucx, disk, fake."""

from dejavulib.transport.base import MessageTransport, Transport
from dejavulib.transport.factory import create_transport

__all__ = ["MessageTransport", "Transport", "create_transport"]
