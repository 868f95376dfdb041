"""Handing a buffer's memory back to the kernel while keeping its addresses: for buffers a transport gave up
on but that something outside Python (UCX) may still write into.

A receive of a message whose sender died mid-message never completes and cannot be cancelled (UCX cancels
only receives not yet matched). Freeing its buffer would leave UCX a dangling pointer, should the sender turn
out to be alive after all; keeping it holds the whole payload for good. :func:`release_pages` does neither:
``madvise(MADV_DONTNEED)`` drops the whole pages inside the buffer, which then read as zeros and take memory
again only if written. This holds for any buffer in private anonymous memory (numpy's, from ``malloc``: the
heap or its own mapping), as long as the buffer object is kept alive: the addresses stay valid and owned.
Linux only (as UCX's shared-memory transports are).
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def release_pages(buffer: np.ndarray) -> int:
    """Give the whole pages inside ``buffer`` (contiguous) back to the kernel; returns how many bytes.

    The buffer stays valid: what lies in the released pages reads as zeros afterwards. The partial pages
    at both ends (under two pages in all) are kept. Raises ``OSError`` if the kernel refuses."""
    if not buffer.flags.c_contiguous:
        raise ValueError("release_pages needs a contiguous buffer")
    start = buffer.ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + buffer.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= first:
        return 0
    if _libc.madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_DONTNEED) failed: {errno}")
    return end - first
