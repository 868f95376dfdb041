"""Every Redis key and stream name DejaVu uses, in one place.

All keys start with ``dejavu:`` and a second component naming the concern; Redis ACLs in
``infra/redis/`` grant each service only the prefixes it needs:

- ``dejavu:worker:*``  worker registry records and leases (workers write their own; controller reads)
- ``dejavu:topology``  the published topology (controller writes, workers read)
- ``dejavu:ctl:*``     controller broadcasts (resume points, recovery orders)
- ``dejavu:wm:*``      replication watermarks and recovery reports (token workers write, controller reads)
- ``dejavu:q:*``       work queues: prompt microbatches, colocated microbatches
- ``dejavu:mb:*``      microbatch specifications and cancellations
- ``dejavu:tok:*``     token streams (last stages write, controller reads)
- ``dejavu:admin:*``   admin commands (admin tool writes, workers read)
"""

from __future__ import annotations

PREFIX = "dejavu"


def worker(worker_id: str) -> str:
    """Hash: a worker's registration record (role, addresses, capabilities, state)."""
    return f"{PREFIX}:worker:{worker_id}"


def worker_kv(worker_id: str) -> str:
    """String with a TTL: a ``messages.KVHeld``, the KV a token worker holds (its caches and replicas),
    renewed with every heartbeat; 0 and 0 once every microbatch it held is released."""
    return f"{PREFIX}:worker:{worker_id}:kv"


def worker_lease(worker_id: str) -> str:
    """String with a TTL: present while the worker is alive; its value is the worker's epoch view."""
    return f"{PREFIX}:worker:{worker_id}:lease"


WORKERS = f"{PREFIX}:worker:index"  # set of registered worker ids
TOPOLOGY = f"{PREFIX}:topology"  # JSON of messages.Topology
TOPOLOGY_CHANNEL = f"{PREFIX}:ctl:topology"  # pub/sub: the epoch, whenever a new topology is published
EPOCH = f"{PREFIX}:topology:epoch"  # integer counter

# Work streams are trimmed (approximately) to this many entries: far beyond any admitted backlog
# (the controller's queue bound), so nothing unread is ever trimmed, but the streams stay bounded.
STREAM_MAXLEN = 10_000

PROMPT_QUEUE = f"{PREFIX}:q:prompt"  # stream of messages.PromptTask (consumer group PROMPT_GROUP)
PROMPT_GROUP = "prompt-stage0"
COLOCATED_QUEUE = f"{PREFIX}:q:colocated"  # stream of messages.PromptTask for the colocated baseline
COLOCATED_GROUP = "token-stage0"
READY_QUEUE = f"{PREFIX}:q:ready"  # stream of messages.PromptDone (first tokens sampled, KV streamed)


def microbatch(mb_id: int) -> str:
    """JSON of messages.MicrobatchSpec."""
    return f"{PREFIX}:mb:{mb_id}"


def microbatch_cancel(mb_id: int) -> str:
    """Set of row indices the controller has cancelled (client gone, stop string)."""
    return f"{PREFIX}:mb:{mb_id}:cancel"


def tokens(mb_id: int) -> str:
    """Stream of messages.TokenStep entries for one token microbatch."""
    return f"{PREFIX}:tok:{mb_id}"


def watermark(stage: int) -> str:
    """Hash microbatch id -> last replicated step of ``stage``'s cache, held by stage + 1."""
    return f"{PREFIX}:wm:{stage}"


def watermark_signatures(stage: int) -> str:
    """Hash microbatch id -> the signature of its ``watermark(stage)`` field (``dejavu_common.signing``)."""
    return f"{PREFIX}:wm:{stage}:sig"


KV_BYTES = f"{PREFIX}:wm:kvbytes"  # hash purpose -> KV bytes the workers streamed (monotonic counters)
CONTROLLER_LEADER = f"{PREFIX}:ctl:leader"  # "<identity>/<instance>" of the controller that acts (with a TTL)
INCARNATION = f"{PREFIX}:ctl:incarnation"  # counter: each controller start takes the next id range
RESUME = f"{PREFIX}:ctl:resume"  # JSON of messages.ResumePoint for the current epoch
RECOVERY = f"{PREFIX}:ctl:recovery"  # JSON of messages.RecoveryOrder for the current epoch


def progress(epoch: int, stage: int) -> str:
    """JSON of messages.StageProgress: what a token stage holds when epoch ``epoch`` begins."""
    return f"{PREFIX}:wm:progress:{epoch}:{stage}"


def restored(epoch: int, stage: int) -> str:
    """Set when a replacement of token ``stage`` has received every cache it must hold at ``epoch`` (to
    ``RESTORED``), or has given up receiving them (to ``RESTORE_FAILED``: every microbatch re-runs)."""
    return f"{PREFIX}:wm:restored:{epoch}:{stage}"


RESTORED, RESTORE_FAILED = b"1", b"failed"


ADMIN_STREAM = f"{PREFIX}:admin:commands"  # stream of messages.AdminCommand
