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

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import RecoveryOrder, ResumePoint, StageProgress
from dejavu_common.signing import EntrySigner, seal
from dejavu_worker.dataplane import frame, unframe
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavulib.endpoint import Message
from dejavulib.errors import IntegrityError
from dejavulib.header import Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import Region
from dejavulib.streamer import region_header
from dejavulib.streaming import region_of

log = logging.getLogger("dejavu.token_worker.recovery")


def recovery_order(client: redis.Redis, epoch: int) -> RecoveryOrder | None:
    raw = client.get(keys.RECOVERY)
    if raw is None:
        return None
    order = RecoveryOrder.decode(raw)
    return order if order.epoch == epoch else None


def report_progress(
    client: redis.Redis,
    epoch: int,
    stage: int,
    signer: EntrySigner,
    done: dict[int, int],
    tables: dict[int, tuple[int, ...]] | None = None,
) -> None:
    """Report what this stage holds at ``epoch`` (and, a request-scheduled stage after the first, its requests'
    tables), sealed with its worker's key (the controller resumes each microbatch from these reports, and accepts
    one only from the stage's holder: dejavu_common.signing)."""
    msg = StageProgress(epoch=epoch, stage=stage, worker_id=signer.worker_id, done=done, tables=tables or {})
    key = keys.progress(epoch, stage)
    client.set(key, seal(signer, key, msg.encode()), ex=3600)


# Which cache a restore message carries, in its header's ``user`` field.
ROLES = {"primary": 1, "replica": 2}
_ROLE_NAMES = {code: name for name, code in ROLES.items()}


@dataclass(frozen=True)
class Restored:
    """One cache received by a replacement: where it goes, the step it holds, its packed bytes."""

    region: Region
    step: int
    message: Message


def restore_digest(parts: Iterable[tuple[Region, int, torch.Tensor | memoryview]]) -> str:
    """A checksum over what a restore carries, in order: each cache's place (microbatch, layers, rows,
    positions), step and packed K/V bytes. The sender puts it in the end marker and the replacement
    checks it over what it received before using any of it: a cache lost, reordered or altered between
    the two caches (not only on the wire, which the transport's MAC covers) fails the restore."""
    h = hashlib.blake2b(digest_size=16)
    for region, step, data in parts:
        _digest_part(h, region, step, data)
    return h.hexdigest()


def _digest_part(h, region: Region, step: int, data: torch.Tensor | memoryview) -> None:
    h.update(f"{region.microbatch}:{region.layers}:{region.rows}:{region.positions}:{step};".encode())
    h.update(data.numpy().data if isinstance(data, torch.Tensor) else data)


def send_caches(
    endpoint: DataEndpoint, peer: str, caches: Iterable[tuple[int, KVCache, int]], role: str
) -> dict[int, int]:
    """Send whole caches ``(microbatch, cache, step)`` to a replacement, one at a time as ``caches``
    yields them; ``role`` is 'primary' (its own cache) or 'replica'. Each is packed once (DejaVuLib's
    buffered copy) and sent as one region message; the end marker carries how many were sent and their
    :func:`restore_digest`. Returns the step sent of each microbatch."""
    h = hashlib.blake2b(digest_size=16)
    sent: dict[int, int] = {}
    for mb, cache, step in caches:
        region = cache.whole(mb)
        packed = cache.pack(region, torch.empty(region.nbytes(cache.layout), dtype=torch.uint8))
        data = packed.reshape(-1).view(torch.uint8)
        header = region_header(Header(Channel.KV_RESTORE, microbatch=mb, step=step, user=ROLES[role]), cache, region)
        endpoint.send_packed(peer, header, data)
        _digest_part(h, region, step, data)
        sent[mb] = step
    end = {"role": role, "end": True, "chunks": len(sent), "digest": h.hexdigest()}
    endpoint.send(peer, Channel.KV_RESTORE, frame(end, None))
    return sent


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
) -> tuple[list[Restored], list[Restored]]:
    """Collect restored caches until the sender of each of ``roles`` said it is done:
    (primary caches, replica caches). With a two-stage pipeline one peer sends both roles.
    Raises :class:`DeadlineExceeded` past the deadline or once ``abandon()`` is true, and
    :class:`IntegrityError` when what arrived for a role is not what its sender's end marker lists
    (count and :func:`restore_digest`)."""
    got: dict[str, list[Restored]] = {"primary": [], "replica": []}
    ended: set[str] = set()
    end = time.monotonic() + deadline_s
    while not roles <= ended:
        left = end - time.monotonic()
        if left <= 0 or abandon():
            raise DeadlineExceeded(f"cache restore incomplete after {deadline_s} s (got {sorted(ended)})")
        message = endpoint.recv_message(Channel.KV_RESTORE, timeout_s=min(left, 0.2))
        if message is None:
            continue
        if not message.header.which:  # an end marker
            meta, _ = unframe(message.payload)
            role = str(meta.get("role"))
            parts = got.get(role, [])
            digest = restore_digest((p.region, p.step, memoryview(p.message.payload)) for p in parts)
            if meta.get("chunks") != len(parts) or meta.get("digest") != digest:
                raise IntegrityError(
                    f"restore of the {role} caches: {len(parts)} arrived, the sender sent "
                    f"{meta.get('chunks')}, or their checksum differs: not using them"
                )
            ended.add(role)
            continue
        role = _ROLE_NAMES.get(message.header.user)
        if role is None:
            raise IntegrityError(f"a restore message of unknown role {message.header.user}")
        got[role].append(Restored(region_of(message.header), message.header.step, message))
    return got["primary"], got["replica"]


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
