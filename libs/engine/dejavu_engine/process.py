"""Process set-up for speed: a preloaded allocator and OpenMP runtime, OpenMP thread binding.

The launcher calls :func:`worker_environment` when it spawns a worker (a library can only be
preloaded by the process that starts another); each service's entry point logs
:func:`describe_runtime` once torch is configured, so a log shows what actually took effect.
Nothing here imports torch: the launcher stays light.

Why: the CPU peers (vLLM-CPU, IPEX) preload tcmalloc and Intel OpenMP and bind OpenMP threads to
cores; tcmalloc serves the many short-lived per-step tensors from thread caches instead of glibc's
arenas, and Intel OpenMP's short spin-then-sleep (``KMP_BLOCKTIME``) suits hosts whose cores are
shared by several workers better than GNU OpenMP's long spin.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from dejavu_common.settings import EngineSettings

# Where Debian/Ubuntu (libtcmalloc-minimal4) and RHEL-likes put tcmalloc; the first found wins.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
IOMP_NAME = "libiomp5.so"  # PyPI's intel-openmp installs it into <prefix>/lib


def find_tcmalloc(dirs: Sequence[str] = LIBRARY_DIRS) -> Path | None:
    """The tcmalloc shared library of this host, or None where it is not installed."""
    for folder in dirs:
        for name in TCMALLOC_NAMES:
            path = Path(folder) / name
            if path.is_file():
                return path
    return None


def find_intel_openmp(prefixes: Sequence[str] | None = None) -> Path | None:
    """Intel OpenMP from the ``intel-openmp`` wheel of this interpreter's environment, or None."""
    for prefix in prefixes if prefixes is not None else dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix) / "lib" / IOMP_NAME
        if path.is_file():
            return path
    return None


def preload_libraries(engine: EngineSettings) -> list[Path]:
    """The libraries to preload into a worker: those the settings ask for and the host has."""
    wanted = [
        find_tcmalloc() if engine.preload_allocator else None,
        find_intel_openmp() if engine.preload_openmp else None,
    ]
    return [path for path in wanted if path is not None]


def worker_environment(engine: EngineSettings, base: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to a worker's environment ``base``: ``LD_PRELOAD`` (kept in front of any
    preload the caller already had) and the OpenMP knobs. Returns only what changes."""
    env: dict[str, str] = {}
    libraries = preload_libraries(engine)
    if libraries:
        present = [p for p in base.get("LD_PRELOAD", "").split(":") if p]
        ours = [str(p) for p in libraries if str(p) not in present]
        env["LD_PRELOAD"] = ":".join([*ours, *present])
    iomp = any(p.name == IOMP_NAME for p in libraries)
    if iomp:
        env["KMP_BLOCKTIME"] = str(engine.openmp_blocktime_ms)
    if engine.openmp_bind:
        # One thread per core of the process's CPU set, neighbours together.
        env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
        if iomp:
            env["KMP_AFFINITY"] = "granularity=fine,compact,1,0"
    return env


def release_free_memory() -> str | None:
    """Hand the memory the allocator keeps of freed blocks back to the OS: tcmalloc's free pages where it
    is preloaded (it otherwise keeps the peak of every size it served, e.g. KV caches of finished
    requests), else glibc's ``malloc_trim``. Returns which ran, or None where neither exists."""
    process = ctypes.CDLL(None)
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        try:
            function = getattr(process, name)
        except AttributeError:
            continue
        function(*args)
        return "tcmalloc" if name.startswith("MallocExtension") else "glibc"
    return None


class MemoryReleaser:
    """Calls :func:`release_free_memory` once a worker that freed memory has been idle for ``quiet_s``:
    between bursts its RSS falls back to what is live instead of staying at the peak, and a busy worker
    never pays for pages it would fault in again at once. Under traffic that never leaves it quiet for
    ``quiet_s`` (a prompt worker with tasks back to back), it releases between two units of work at most
    every ``every_s``, so what the allocator keeps of freed memory stays bounded there too. The serving
    loop reports what it frees (:meth:`freed`) and when it works (:meth:`busy`); the worker's control
    thread asks :meth:`maybe_release` once per beat. Thread-safe."""

    def __init__(self, quiet_s: float = 2.0, every_s: float = 30.0) -> None:
        self.quiet_s = quiet_s
        self.every_s = every_s
        self._lock = threading.Lock()
        self._freed_at: float | None = None
        self._released_at = time.monotonic()
        self._busy = 0

    def freed(self) -> None:
        """Something large was freed (a finished microbatch's cache, a prompt task's)."""
        with self._lock:
            self._freed_at = time.monotonic()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a unit of work: no release while it runs; what it allocated counts as freed after."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._freed_at = time.monotonic()

    def maybe_release(self, idle: bool = True) -> bool:
        """Release if memory was freed, nothing runs (``idle``: nor holds state, by the caller's own
        account), and either ``quiet_s`` passed since the last free or ``every_s`` since the last
        release. Returns whether it released."""
        with self._lock:
            now = time.monotonic()
            if not idle or self._busy or self._freed_at is None:
                return False
            if now - self._freed_at < self.quiet_s and now - self._released_at < self.every_s:
                return False
            self._freed_at, self._released_at = None, now
        release_free_memory()
        return True


#: Intel OpenMP registers each process that loads it with a file in /dev/shm, removed at a normal exit; a
#: SIGKILLed worker (every failure test, every chaos fault) leaves its file behind for good.
OPENMP_REGISTRATION = re.compile(r"__KMP_REGISTERED_LIB_(\d+)(_\d+)?")


def sweep_openmp_registrations(folder: Path = Path("/dev/shm")) -> int:
    """Remove the Intel OpenMP registration files of processes that no longer exist (ours only: a file
    another user owns stays); returns how many. Each worker calls it as it starts, so the files of the
    workers killed before it go with it."""
    removed = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for path in entries:
        match = OPENMP_REGISTRATION.fullmatch(path.name)
        if match is None:
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        except OSError:  # gone meanwhile, or a live process of another user (PermissionError)
            continue
    return removed


def loaded_libraries(names: Sequence[str] = ("tcmalloc", "iomp5", "gomp")) -> list[str]:
    """Which of ``names`` are mapped into this process (read from /proc/self/maps; [] elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return [name for name in names if name in maps]


def describe_runtime() -> str:
    """One log line: torch threads (where torch is imported), CPU set, OpenMP binding, and the
    allocator and OpenMP libraries actually loaded."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else "not set"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (
        f"torch threads {threads}, cores {cores}, OpenMP binding {os.environ.get('OMP_PROC_BIND', 'off')}, "
        f"loaded {', '.join(loaded_libraries()) or 'no tcmalloc/OpenMP library'} "
        f"(LD_PRELOAD={os.environ.get('LD_PRELOAD') or '-'})"
    )
