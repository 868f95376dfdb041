"""A whole DejaVu deployment as real processes (controller + workers) on the test session's Redis."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import redis
from pydantic import SecretStr

from dejavu_cli.launcher import Launcher
from dejavu_common import keys
from dejavu_common.admin import generate_keypair
from dejavu_common.messages import KVHeld, Topology
from dejavu_common.settings import Mode, Settings

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_settings(
    redis_url: str,
    model: Path,
    *,
    mode: Mode = Mode.DISAGGREGATED,
    prompt_depth: int = 1,
    token_depth: int = 1,
    prompt_microbatch: int = 4,
    token_microbatch: int = 4,
    **overrides: dict,
) -> Settings:
    base = Settings()
    signing, verify = generate_keypair()  # the tests sign admin orders; the launcher gives workers `verify`
    parts = {
        "admin": base.admin.model_copy(update={"signing_key": SecretStr(signing), "verify_key": verify}),
        "transport": base.transport.model_copy(update={"secret": SecretStr(secrets.token_hex(32))}),
        "redis": base.redis.model_copy(update={"url": redis_url}),
        "model": base.model.model_copy(update={"path": model}),
        "engine": base.engine.model_copy(update={"torch_threads": 1}),
        "controller": base.controller.model_copy(
            update={
                "port": _free_port(),
                "mode": mode,
                "prompt_depth": prompt_depth,
                "token_depth": token_depth,
                "prompt_microbatch": prompt_microbatch,
                "token_microbatch": token_microbatch,
                "batch_wait_ms": 30.0,
            }
        ),
    }
    for name, update in overrides.items():  # merged onto the parts above (e.g. controller={"host": ...})
        parts[name] = parts.get(name, getattr(base, name)).model_copy(update=update)
    return base.model_copy(update=parts)


@contextlib.contextmanager
def running(
    settings: Settings, spares: int = 0, prompt_spares: int = 0, ready_timeout_s: float = 180.0
) -> Iterator[Launcher]:
    """Start the deployment, wait for /ready, yield the launcher; stop every process by PID after."""
    launcher = Launcher(settings, spares=spares, prompt_spares=prompt_spares, restart_workers=False)
    try:
        launcher.start()
        launcher.wait_ready(ready_timeout_s)
        yield launcher
        assert_kv_released(settings.redis.url)
    except BaseException:
        launcher.stop()
        print(f"process logs kept in {launcher.log_dir}")
        raise
    launcher.stop()
    if os.environ.get("DEJAVU_TEST_KEEP_LOGS"):  # for studying a run that passed (slowly, say)
        print(f"process logs kept in {launcher.log_dir}")
    else:
        shutil.rmtree(launcher.log_dir, ignore_errors=True)


def kv_held(redis_url: str) -> dict[str, KVHeld]:
    """What each live worker reports holding (caches and replicas) as of its last heartbeat."""
    client = redis.Redis.from_url(redis_url)
    try:
        out = {}
        for raw in client.smembers(keys.WORKERS):
            worker = raw.decode()
            held = client.get(keys.worker_kv(worker))
            if held is not None and client.exists(keys.worker_lease(worker)):
                out[worker] = KVHeld.decode(held)
        return out
    finally:
        client.close()


def assert_kv_released(redis_url: str, timeout_s: float = 20.0) -> None:
    """Memory accounting: once every request has ended, every worker holds no microbatch's KV."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = kv_held(redis_url)
        if all(h.microbatches == 0 and h.bytes == 0 for h in held.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held {timeout_s} s after the last request: {held}")
        time.sleep(0.25)


_UCX_LINE = re.compile(r"\[\d+\.\d+\] \[[^\]]*\]")  # UCX's log prefix: [time] [host:pid:thread]


def _ucx_table(line: str) -> bool:
    return bool(_UCX_LINE.match(line)) and " ERROR " not in line and " WARN " not in line


def logs(launcher: Launcher, tail: int | None = 4000) -> str:
    """Every process log: the last ``tail`` characters of each for assertion messages, whole with ``tail=None``.

    The tails leave out UCX's protocol tables (printed at each connection, they would otherwise fill
    them), not its errors and warnings; the whole text keeps everything.
    """
    parts = []
    for p in sorted(launcher.log_dir.glob("*.log")):
        text = p.read_text()
        if tail:
            text = "".join(line for line in text.splitlines(keepends=True) if not _ucx_table(line))[-tail:]
        parts.append(f"--- {p.name}\n{text}")
    return "\n".join(parts)


def token_stage_worker(settings: Settings, stage: int) -> str:
    """The worker that holds token stage ``stage`` in the published topology."""
    client = redis.Redis.from_url(settings.redis.url)
    try:
        return Topology.decode(client.get(keys.TOPOLOGY)).token_stages[stage].worker_id
    finally:
        client.close()


def killed_mid_stream(launcher: Launcher, victim: str, stream: Callable[[threading.Event], T]) -> T:
    """Run ``stream(progress)`` (a client's request) on a thread, SIGKILL worker ``victim`` once it sets
    ``progress``, and return what it returns. Asserts the request was still under way when the worker died,
    then did not hang, raised nothing, and that the controller repaired the pipelines."""
    progress = threading.Event()
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(stream(progress))
        except BaseException as exc:  # asserted below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert progress.wait(120), f"the stream made no progress\n{logs(launcher)}"
    os.kill(launcher.child(victim).proc.pid, signal.SIGKILL)
    assert not result, "the request ended before the worker was killed"
    thread.join(240)
    assert not thread.is_alive(), "the request hung"
    assert not errors, f"{errors}\n{logs(launcher)}"
    assert "repairing the pipelines" in logs(launcher, tail=None)
    return result[0]
