"""A token stage's part in repairing the pipeline at a new epoch (the paper's recovery steps 2-4).

At the start of an epoch that follows failures (a :class:`RecoveryOrder` for that epoch exists):

- a *survivor* reports how far its own cache reaches per microbatch (:class:`StageProgress`);
- the stage after a replaced stage sends it the replica it keeps (the replaced stage's own cache);
- the stage before a replaced stage sends it its own cache (the replica the replaced stage keeps);
- a *replacement* receives both, then marks itself restored;
- every stage then waits for the controller's :class:`ResumePoint` and drops what must be re-run.

Every wait has a deadline; a missed deadline raises :class:`DeadlineExceeded` and the worker goes
back to waiting for the next topology.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import RecoveryOrder, ResumePoint, StageProgress
from dejavu_worker.dataplane import KVChunk, frame, unframe
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavulib.errors import IntegrityError

log = logging.getLogger("dejavu.token_worker.recovery")


def recovery_order(client: redis.Redis, epoch: int) -> RecoveryOrder | None:
    raw = client.get(keys.RECOVERY)
    if raw is None:
        return None
    order = RecoveryOrder.decode(raw)
    return order if order.epoch == epoch else None


def report_progress(client: redis.Redis, epoch: int, stage: int, worker_id: str, done: dict[int, int]) -> None:
    msg = StageProgress(epoch=epoch, stage=stage, worker_id=worker_id, done=done)
    client.set(keys.progress(epoch, stage), msg.encode(), ex=3600)


def restore_digest(chunks: list[KVChunk]) -> str:
    """A checksum over what a restore carries, in order: each chunk's place (microbatch, layers, rows,
    positions, step) and its K and V bytes. The sender puts it in the end marker and the replacement
    checks it over what it received before using any of it: a chunk lost, reordered or altered between
    the two caches (not only on the wire, which the transport's MAC covers) fails the restore."""
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(f"{c.mb_id}:{c.layers}:{c.rows}:{c.positions}:{c.step};".encode())
        for t in (c.k, c.v):
            t = t.detach().to("cpu").contiguous()
            h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().data)
    return h.hexdigest()


def send_caches(endpoint: DataEndpoint, peer: str, chunks: list[KVChunk], role: str) -> None:
    """Send whole caches to a replacement; ``role`` is 'primary' (its own cache) or 'replica'. The end
    marker carries how many chunks were sent and their :func:`restore_digest`."""
    for chunk in chunks:
        endpoint.send(peer, Channel.KV_RESTORE, dataclasses.replace(chunk, role=role).encode())
    end = {"role": role, "end": True, "chunks": len(chunks), "digest": restore_digest(chunks)}
    endpoint.send(peer, Channel.KV_RESTORE, frame(end, None))


def expected_roles(stage: int, depth: int, replaced: set[int]) -> set[str]:
    """What a replacement of ``stage`` receives: its own cache from a surviving successor ('primary'),
    the replica it keeps from a surviving predecessor ('replica'). A replaced neighbour sends nothing."""
    roles = set()
    if depth > 1 and (stage + 1) % depth not in replaced:
        roles.add("primary")
    if depth > 1 and (stage - 1) % depth not in replaced:
        roles.add("replica")
    return roles


def receive_caches(
    endpoint: DataEndpoint, roles: set[str], deadline_s: float, abandon: Callable[[], bool]
) -> tuple[list[KVChunk], list[KVChunk]]:
    """Collect restore chunks until the sender of each of ``roles`` said it is done:
    (primary chunks, replica chunks). With a two-stage pipeline one peer sends both roles.
    Raises :class:`DeadlineExceeded` past the deadline or once ``abandon()`` is true, and
    :class:`IntegrityError` when what arrived for a role is not what its sender's end marker lists
    (count and :func:`restore_digest`)."""
    primary: list[KVChunk] = []
    replica: list[KVChunk] = []
    got = {"primary": primary, "replica": replica}
    ended: set[str] = set()
    end = time.monotonic() + deadline_s
    while not roles <= ended:
        left = end - time.monotonic()
        if left <= 0 or abandon():
            raise DeadlineExceeded(f"cache restore incomplete after {deadline_s} s (got {sorted(ended)})")
        payload = endpoint.recv(Channel.KV_RESTORE, timeout_s=min(left, 0.2))
        if payload is None:
            continue
        meta, _ = unframe(payload)
        if meta.get("end"):
            role = str(meta.get("role"))
            chunks = got.get(role, [])
            if meta.get("chunks") != len(chunks) or meta.get("digest") != restore_digest(chunks):
                raise IntegrityError(
                    f"restore of the {role} caches: {len(chunks)} chunk(s) arrived, the sender sent "
                    f"{meta.get('chunks')}, or their checksum differs: not using them"
                )
            ended.add(role)
            continue
        chunk = KVChunk.decode(payload)
        (primary if chunk.role == "primary" else replica).append(chunk)
    return primary, replica


def wait_resume(client: redis.Redis, epoch: int, deadline_s: float, abandon: Callable[[], bool]) -> ResumePoint:
    """The controller's resume point for ``epoch``; :class:`DeadlineExceeded` past the deadline or
    as soon as ``abandon()`` is true (a newer epoch began: a failure during recovery)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not abandon():
        raw = client.get(keys.RESUME)
        if raw is not None:
            point = ResumePoint.decode(raw)
            if point.epoch == epoch:
                return point
        time.sleep(0.01)
    raise DeadlineExceeded(f"no resume point for epoch {epoch} after {deadline_s} s")
