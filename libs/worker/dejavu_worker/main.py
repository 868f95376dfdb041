"""Command line shared by the worker services: ``python -m dejavu_<role>_worker --worker-id ID``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import sys

from dejavu_common import keys, logs, tracing
from dejavu_common.redis_client import sync_client
from dejavu_common.settings import Settings
from dejavu_engine.process import describe_runtime, sweep_openmp_registrations


def worker_main(role: str, worker_class: str, argv: list[str] | None = None) -> int:
    """Parse the command line and run the worker ``worker_class`` ('module:Class'), imported only
    after ``--check`` was handled so the liveness probe does not import torch."""
    parser = argparse.ArgumentParser(prog=f"dejavu-{role}-worker", description=f"DejaVu {role} worker")
    parser.add_argument(
        "--worker-id", default=os.environ.get("DEJAVU_WORKER_ID") or f"{role[0]}-{socket.gethostname()}"
    )
    parser.add_argument("--spare", action="store_true", help="register as a spare that takes over failed stages")
    parser.add_argument("--redis-url", help="overrides DEJAVU_REDIS__URL")
    parser.add_argument("--check", action="store_true", help="liveness probe: exit 0 iff this worker's lease is live")
    args = parser.parse_args(argv)
    settings = Settings()
    if args.redis_url:
        settings = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": args.redis_url})})
    if args.check:
        try:
            return 0 if sync_client(settings.redis).exists(keys.worker_lease(args.worker_id)) else 1
        except Exception as exc:
            print(f"check failed: {exc}", file=sys.stderr)
            return 1
    logs.configure(settings.log_level, f"{role}-worker", args.worker_id, settings.log_format)
    tracing.configure(settings.tracing, f"dejavu-{role}-worker", args.worker_id)
    if settings.engine.cpu_affinity:
        os.sched_setaffinity(0, settings.engine.cpu_affinity)  # before torch starts its thread pool
    module, name = worker_class.split(":")
    factory = getattr(importlib.import_module(module), name)
    worker = factory(settings, args.worker_id, args.spare)
    log = logging.getLogger("dejavu.worker")
    log.info("runtime: %s", describe_runtime())
    if swept := sweep_openmp_registrations():
        log.info("removed the Intel OpenMP registration files of %d processes that are gone", swept)
    return worker.run()
