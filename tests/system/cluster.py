"""A whole DejaVu deployment as real processes (controller + workers) on the test session's Redis."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from pydantic import SecretStr

from dejavu_cli.launcher import Launcher
from dejavu_common.admin import generate_keypair
from dejavu_common.settings import Mode, Settings


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
    except BaseException:
        launcher.stop()
        print(f"process logs kept in {launcher.log_dir}")
        raise
    launcher.stop()
    shutil.rmtree(launcher.log_dir, ignore_errors=True)


def logs(launcher: Launcher, tail: int | None = 3000) -> str:
    """Every process log: the last ``tail`` characters of each for assertion messages, whole with ``tail=None``.

    Search the whole text (``tail=None``): UCX's protocol tables alone can fill a worker log's tail.
    """
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-tail if tail else 0 :]}" for p in sorted(launcher.log_dir.glob("*.log"))
    )
