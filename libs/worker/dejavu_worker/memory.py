"""What memory a worker may size its KV pools by."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory_bytes() -> int:
    """Memory the host can still give (Linux ``MemAvailable``; elsewhere physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
