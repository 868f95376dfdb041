"""Build the configured transport from ``TransportSettings`` (duck-typed: this library imports no settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from dejavulib.transport.base import Transport


class TransportConfig(Protocol):
    """The fields of ``dejavu_common.settings.TransportSettings`` this factory reads."""

    kind: str
    ucx_require: str | None
    ucx_progress: str


def create_transport(settings: TransportConfig, self_id: str, disk_dir: Path | None = None) -> Transport:
    """A transport of ``settings.kind`` for peer ``self_id``; ``disk_dir`` is required for ``disk``."""
    if settings.kind == "ucx":
        from dejavulib.transport.ucx import UcxTransport

        return UcxTransport(self_id, progress=settings.ucx_progress, require=settings.ucx_require)
    if settings.kind == "local":
        from dejavulib.transport.local import LocalTransport

        return LocalTransport(self_id)
    if settings.kind == "fake":
        from dejavulib.transport.fake import FakeTransport

        return FakeTransport(self_id)
    if settings.kind == "disk":
        if disk_dir is None:
            raise ValueError("the disk transport needs disk_dir")
        from dejavulib.transport.disk import DiskTransport

        return DiskTransport(self_id, disk_dir)
    raise ValueError(f"unknown transport kind {settings.kind!r}")
