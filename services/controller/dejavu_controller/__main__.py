"""``python -m dejavu_controller``: the REST gateway and the controller in one process."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator

from dejavu_common import logs, tracing
from dejavu_common.kv_budget import KVBudgetError
from dejavu_common.redis_client import async_client
from dejavu_common.settings import Settings
from dejavu_controller.kv_admission import admitted_microbatch
from dejavu_controller.model_info import count_layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu-controller", description="DejaVu controller + REST gateway")
    parser.add_argument("--redis-url", help="overrides DEJAVU_REDIS__URL")
    parser.add_argument("--host", help="overrides DEJAVU_CONTROLLER__HOST")
    parser.add_argument("--port", type=int, help="overrides DEJAVU_CONTROLLER__PORT")
    args = parser.parse_args(argv)
    settings = Settings()
    if args.redis_url:
        settings = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": args.redis_url})})
    ctl = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    if ctl:
        settings = settings.model_copy(update={"controller": settings.controller.model_copy(update=ctl)})
    logs.configure(settings.log_level, "controller", log_format=settings.log_format)
    tracing.configure(settings.tracing, "dejavu-controller", settings.controller.identity)
    n_layers = count_layers(settings.model.folder)
    try:
        microbatch = admitted_microbatch(settings, n_layers)
    except KVBudgetError as exc:
        print(f"dejavu-controller: configuration refused: {exc}", file=sys.stderr)
        return 2
    if microbatch != settings.controller.token_microbatch:
        settings = settings.model_copy(
            update={"controller": settings.controller.model_copy(update={"token_microbatch": microbatch})}
        )

    from dejavu_controller.api.server import run_api
    from dejavu_controller.pipeline_backend import PipelineBackend

    @contextlib.asynccontextmanager
    async def backend_factory(settings: Settings, metrics) -> AsyncIterator[PipelineBackend]:
        redis = async_client(settings.redis)
        try:
            async with PipelineBackend(settings, redis, n_layers, metrics) as backend:
                yield backend
        finally:
            await redis.aclose()

    run_api(settings, backend_factory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
