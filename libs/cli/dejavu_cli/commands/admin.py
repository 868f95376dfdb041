"""``dejavu admin``: operations and failure injection over Redis.

Commands are Ed25519-signed with the admin signing key (``DEJAVU_ADMIN__SIGNING_KEY``), bound to the
target worker's current instance and valid for ``admin.command_ttl_s``; workers hold only the verify
key and refuse anything else (``dejavu_common.admin``). ``dejavu admin keygen`` prints a fresh pair.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("admin", help="inspect the system and inject failures (through Redis)")
    p.add_argument("--redis-url", help="Redis URL (default: settings)")
    sub = p.add_subparsers(dest="admin_command", required=True, metavar="ACTION")
    s = sub.add_parser("status", help="topology, epoch, leases, watermarks, spares, microbatch progress")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)
    k = sub.add_parser("kill-worker", help="the worker exits abruptly, as in a crash")
    k.add_argument("worker_id")
    k.set_defaults(func=_order, action="kill")
    h = sub.add_parser("pause-heartbeats", help="the worker stops renewing its lease for SECONDS")
    h.add_argument("worker_id")
    h.add_argument("seconds", type=float)
    h.set_defaults(func=_order, action="pause-heartbeats")
    d = sub.add_parser("drain", help="the worker finishes its work and leaves")
    d.add_argument("worker_id")
    d.set_defaults(func=_order, action="drain")
    g = sub.add_parser("keygen", help="print a fresh Ed25519 admin key pair as DEJAVU_ADMIN__* lines")
    g.set_defaults(func=_keygen)


def _client(args: argparse.Namespace):
    from dejavu_common.redis_client import sync_client
    from dejavu_common.settings import Settings

    settings = Settings()
    if args.redis_url:
        settings = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": args.redis_url})})
    if settings.admin.signing_key is None and (key := _local_signing_key()) is not None:
        settings = settings.model_copy(update={"admin": settings.admin.model_copy(update={"signing_key": key})})
    return settings, sync_client(settings.redis)


def _local_signing_key():
    """The signing key ``dejavu up`` made for the local deployment it runs, if any."""
    from pydantic import SecretStr

    from dejavu_cli.launcher import ADMIN_KEY_NAME
    from dejavu_cli.rundir import read_private, run_dir

    text = read_private(run_dir() / ADMIN_KEY_NAME)
    if text is None:
        return None
    name, _, value = text.strip().partition("=")
    return SecretStr(value) if name == "DEJAVU_ADMIN__SIGNING_KEY" and value else None


def _order(args: argparse.Namespace) -> int:
    from dejavu_cli.main import CLIError
    from dejavu_common import keys
    from dejavu_common.admin import sign
    from dejavu_common.messages import AdminAction, WorkerInfo

    settings, client = _client(args)
    if settings.admin.signing_key is None:
        raise CLIError("no admin signing key: set DEJAVU_ADMIN__SIGNING_KEY (see `dejavu admin keygen`)")
    raw = client.hget(keys.worker(args.worker_id), "info")
    if not client.sismember(keys.WORKERS, args.worker_id) or raw is None:
        raise CLIError(f"no registered worker {args.worker_id!r}")
    cmd = sign(
        settings.admin.signing_key.get_secret_value(),
        args.worker_id,
        WorkerInfo.decode(raw).instance,  # the order is void for any later restart of the worker
        AdminAction(args.action),
        seconds=getattr(args, "seconds", 0.0),
        ttl_s=settings.admin.command_ttl_s,
    )
    client.xadd(keys.ADMIN_STREAM, {"cmd": cmd.encode()}, maxlen=1000, approximate=True)
    print(f"sent {args.action} to {args.worker_id} (command {cmd.command_id})")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from dejavu_common.admin import generate_keypair

    signing, verify = generate_keypair()
    print(f"DEJAVU_ADMIN__SIGNING_KEY={signing}")
    print(f"DEJAVU_ADMIN__VERIFY_KEY={verify}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from dejavu_common import keys
    from dejavu_common.messages import Topology, WorkerInfo

    _settings, client = _client(args)
    raw = client.get(keys.TOPOLOGY)
    topo = Topology.decode(raw) if raw else None
    workers = {}
    for wid in sorted(m.decode() for m in client.smembers(keys.WORKERS)):
        rec = client.hgetall(keys.worker(wid))
        if b"info" not in rec:
            continue
        info = WorkerInfo.decode(rec[b"info"])
        ttl = client.pttl(keys.worker_lease(wid))
        stage = topo.stage_of(wid) if topo else None
        workers[wid] = {
            "role": info.role.value,
            "spare": info.spare,
            "state": rec.get(b"state", b"?").decode(),
            "epoch": int(rec.get(b"epoch", b"0")),
            "lease_ms": ttl if ttl > 0 else None,
            "stage": None if stage is None else {"stage": stage.stage, "layers": list(stage.layers)},
            "pid": info.pid,
            "host": info.host,
            "metrics_url": info.metrics_url,
        }
    watermarks = {}
    if topo is not None:
        for a in topo.token_stages:
            wm = client.hgetall(keys.watermark(a.stage))
            watermarks[a.stage] = {int(k): int(v) for k, v in wm.items()}
    microbatches = {}
    for key in client.scan_iter(match=keys.tokens(0).rsplit(":", 1)[0] + ":*"):
        mb = int(key.decode().rsplit(":", 1)[1])
        microbatches[mb] = {"entries": client.xlen(key)}
    status = {
        "epoch": topo.epoch if topo else None,
        "mode": topo.mode if topo else None,
        "workers": workers,
        "watermarks": watermarks,
        "microbatches": microbatches,
    }
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"epoch {status['epoch']}  mode {status['mode']}")
    for wid, w in workers.items():
        stage = f"stage {w['stage']['stage']} layers {w['stage']['layers']}" if w["stage"] else "no stage"
        lease = f"{w['lease_ms']} ms" if w["lease_ms"] else "EXPIRED"
        metrics = f"  metrics {w['metrics_url']}" if w["metrics_url"] else ""
        print(f"  {wid:10s} {w['role']:6s} {'spare ' if w['spare'] else ''}{w['state']:8s} {stage:28s} lease {lease}"
              f"{metrics}")  # fmt: skip
    for stage, wm in watermarks.items():
        print(f"  watermarks of stage {stage}: {wm}")
    for mb, info in sorted(microbatches.items()):
        print(f"  microbatch {mb}: {info['entries']} token steps")
    return 0
