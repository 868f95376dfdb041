"""The replica a token stage keeps of its predecessor (real Redis): it takes host pool blocks as the steps
come and returns a finished request's at once, a step that arrives after its microbatch was released does
not bring the microbatch back, a full pool drops a replica rather than grow past its bound, and a replica
kept on disk (through DejaVuLib's disk transport, no host memory) restores the same cache as one in memory."""

from __future__ import annotations

import pytest
import redis
import torch

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_common.settings import Replication
from dejavu_token_worker.replication import ReplicaStore
from dejavulib.endpoint import Message
from dejavulib.errors import IntegrityError
from dejavulib.header import Channel, Header
from dejavulib.layout import Region


def _store(client: redis.Redis, tmp_path, mode: Replication = Replication.BOTH) -> ReplicaStore:
    row = RowSpec(request_id="r", prompt_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=100, seed=0))
    client.set(keys.microbatch(5), MicrobatchSpec(mb_id=5, rows=(row,), prompt_len=3, max_len=200).encode())
    return ReplicaStore(client, None, 1, (2, 4), (2, 8, "float32"), mode, tmp_path, 1.0, worker_id="t1")  # type: ignore[arg-type]


def _chunk(p0: int, p1: int, step: int) -> tuple[Region, int, Message]:
    """What the predecessor's streamer sends after step ``step``: positions [p0, p1) of every layer and row."""
    k = torch.full((2, 1, 2, p1 - p0, 8), float(step))
    data = torch.stack((k, k)).reshape(-1).view(torch.uint8).numpy()
    header = Header(Channel.KV_REPLICA, microbatch=5, step=step, layers=(2, 4), rows=(0, 1), positions=(p0, p1),
                    which=3, nbytes=data.nbytes)  # fmt: skip
    return Region(5, (2, 4), (0, 1), (p0, p1)), step, Message(header, data)


@pytest.mark.parametrize("mode", [Replication.MEMORY, Replication.DISK, Replication.BOTH])
def test_a_replica_grows_with_the_steps_and_a_late_step_after_release_is_ignored(redis_url, tmp_path, mode) -> None:
    client = redis.Redis.from_url(redis_url)
    store = _store(client, tmp_path, mode)
    store.store(*_chunk(0, 3, 0))  # the prompt
    if mode is Replication.DISK:
        assert store.replicas[5].layout.max_len == 67  # the prompt plus 64, doubling as the steps come
    else:  # one block of 16 positions taken so far, of a pool that knows nothing of the span
        assert store.pool is not None and store.pool.used_blocks == 1 and store.replicas[5].cache.blocks_held == 1
    for step in range(1, 70):  # decode steps write one position each
        store.store(*_chunk(2 + step, 3 + step, step))
    assert store.watermark(5) == 69
    if mode is Replication.DISK:
        assert store.replicas[5].layout.max_len == 134
    else:
        assert store.pool.used_blocks == 5  # positions [0, 72): blocks as the positions came, none for the span
    [(mb, cache, step)] = store.restorable([5, 6])  # 6 is not held here
    assert (mb, step) == (5, 69)
    dense = cache.dense(72) if mode is not Replication.DISK else cache
    assert torch.equal(dense.k[0, 0, 0, 71], torch.full((8,), 69.0))
    assert torch.equal(dense.v[1, 0, 1, 2], torch.full((8,), 0.0)) and torch.equal(dense.v[1, 0, 1, 3], torch.ones(8))
    in_memory = sum(c.nbytes for c in store.memory_caches())
    assert (in_memory == 0) == (mode is Replication.DISK)
    files = list(store.disk.root.glob("*.kv")) if store.disk is not None else []
    assert len(files) == (70 if mode is not Replication.MEMORY else 0)  # one chunk per message, on disk
    assert client.hget(keys.watermark(1), 5) == b"69"
    store.drop(5, finished=True)
    assert store.pool is None or store.pool.used_blocks == 0  # every block back in the pool
    store.store(*_chunk(72, 73, 70))  # in flight when the microbatch finished
    store.store(*_chunk(0, 3, 0))  # even its prompt's replica, overtaken by the release
    assert store.microbatches() == set() and store.watermark(5) == -1
    assert client.hget(keys.watermark(1), 5) is None
    assert store.pool is None or store.pool.used_blocks == 0
    assert not list(tmp_path.rglob("*.kv"))  # no replica chunk stays or comes back either
    store.close()
    assert _folders(tmp_path) == []  # the process's folder (and its lease) is gone with its store
    client.close()


def _two_row_spec(client: redis.Redis, mb: int = 7) -> None:
    rows = tuple(
        RowSpec(request_id=f"r{i}", prompt_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=100, seed=0))
        for i in range(2)
    )
    client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=rows, prompt_len=3, max_len=200).encode())


def _rows_chunk(mb: int, p0: int, p1: int, step: int, rows: int = 2) -> tuple[Region, int, Message]:
    k = torch.full((2, rows, 2, p1 - p0, 8), float(step + 1))
    data = torch.stack((k, k)).reshape(-1).view(torch.uint8).numpy()
    header = Header(Channel.KV_REPLICA, microbatch=mb, step=step, layers=(2, 4), rows=(0, rows), positions=(p0, p1),
                    which=3, nbytes=data.nbytes)  # fmt: skip
    return Region(mb, (2, 4), (0, rows), (p0, p1)), step, Message(header, data)


def test_a_replica_returns_a_finished_rows_blocks_and_its_pool_bound_drops_what_does_not_fit(
    redis_url, tmp_path
) -> None:
    """The replica pool holds blocks, not spans: a request that ends gives its row's blocks back at once
    (the rows still running keep theirs and their data), and a replica that finds the pool full is
    dropped with its watermark (a failure then re-runs that prompt) while the others keep replicating."""
    client = redis.Redis.from_url(redis_url)
    _two_row_spec(client, 7)
    _two_row_spec(client, 8)
    block = 2 * 2 * 2 * 16 * 8 * 4  # K and V, 2 layers, 2 heads, 16 positions of 8 float32
    store = ReplicaStore(client, None, 1, (2, 4), (2, 8, "float32"), Replication.MEMORY, tmp_path, 1.0,  # type: ignore[arg-type]
                         worker_id="t1", block_size=16, memory_bytes=6 * block)  # fmt: skip
    assert store.pool is not None and store.pool.max_blocks == 6
    store.store(*_rows_chunk(7, 0, 3, 0))
    for step in range(1, 20):
        store.store(*_rows_chunk(7, 2 + step, 3 + step, step))  # positions [0, 22): 2 blocks per row
    assert store.pool.used_blocks == 4 and store.watermark(7) == 19
    store.retire_rows(7, (1,))  # row 0's request ended
    assert store.pool.used_blocks == 2
    store.retire_rows(7, (1,))  # again: nothing more to return
    assert store.pool.used_blocks == 2
    for step in range(20, 30):  # row 1 goes on; chunks still carry both rows, row 0's part is skipped
        store.store(*_rows_chunk(7, 2 + step, 3 + step, step))
    assert store.pool.used_blocks == 2 and store.watermark(7) == 29
    [(_, cache, _)] = store.restorable([7])
    dense = cache.dense(32)
    assert torch.equal(dense.k[0, 1, 0, 31], torch.full((8,), 30.0))  # row 1 holds its data
    assert torch.equal(dense.k[0, 0, 0, 5], torch.zeros(8))  # row 0's blocks are gone

    store.store(*_rows_chunk(8, 0, 3, 0))  # microbatch 8 takes 2 blocks (4 used of 6)
    for step in range(1, 14):
        store.store(*_rows_chunk(8, 2 + step, 3 + step, step))
    assert store.watermark(8) == 13 and store.pool.used_blocks == 4
    store.store(*_rows_chunk(8, 15, 16, 14))  # position 15 fits: still in the first blocks
    store.store(*_rows_chunk(8, 16, 17, 15))  # position 16 needs 2 blocks: 2 left, fits
    assert store.pool.used_blocks == 6 and store.watermark(8) == 15
    store.store(*_rows_chunk(7, 31, 32, 29))  # a step re-sent (a resume) within its blocks: fine
    store.store(*_rows_chunk(7, 32, 33, 30))  # row 1 needs a third block, none is left: 7's replica is dropped
    assert store.microbatches() == {8} and store.watermark(7) == -1
    assert client.hget(keys.watermark(1), 7) is None and store.pool.used_blocks == 4
    store.store(*_rows_chunk(7, 33, 34, 31))  # its later steps are ignored, not a replica from mid-way
    assert store.microbatches() == {8} and store.pool.used_blocks == 4
    store.store(*_rows_chunk(8, 17, 18, 16))  # microbatch 8 replicates on
    assert store.watermark(8) == 16
    store.close()
    assert store.pool.used_blocks == 0
    client.close()


def _folders(base) -> list[str]:
    """The replica folders under ``base``, and the lock files of their leases (``.owners``)."""
    owners = base / ".owners"
    leases = sorted(p.name for p in owners.iterdir()) if owners.exists() else []
    return sorted(p.name for p in base.iterdir() if p.name != ".owners") + [f"lease:{n}" for n in leases]


_HOLD = """
import sys, time
from pathlib import Path
from dejavulib.transport.disk import FolderLease
base, owner = Path(sys.argv[1]), sys.argv[2]
lease = FolderLease(base, owner)
(base / owner).mkdir(mode=0o700)
(base / owner / (owner + ".0.kv")).write_bytes(b"kv")
print("held", flush=True)
time.sleep(60)
"""


def test_a_disk_replica_store_removes_the_folders_of_processes_that_died_and_rejects_a_wrong_size(
    redis_url, tmp_path
) -> None:
    """Worker processes on one host share ``replica_dir``: a store that opens removes the folders of the
    processes that died (their leases were dropped by the kernel), never a live one's."""
    import signal
    import subprocess
    import sys

    holders = {}
    for owner in ("t7.100", "t8.200"):
        holders[owner] = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(tmp_path), owner], stdout=subprocess.PIPE, text=True
        )
        assert holders[owner].stdout.readline().strip() == "held"  # type: ignore[union-attr]
    try:
        holders["t7.100"].send_signal(signal.SIGKILL)  # dies holding its lease and one chunk
        holders["t7.100"].wait(10)
        client = redis.Redis.from_url(redis_url)
        store = _store(client, tmp_path, Replication.DISK)
        mine = store.disk.root.name  # type: ignore[union-attr]
        assert mine.startswith("t1.")  # one folder per process: the worker id and its pid
        assert _folders(tmp_path) == sorted([mine, "t8.200"]) + sorted([f"lease:{mine}", "lease:t8.200"])
        region, step, message = _chunk(0, 3, 0)
        short = Message(message.header, message.payload[:-4])
        with pytest.raises(IntegrityError):
            store.store(region, step, short)
        assert not list(store.disk.root.iterdir()) and store.watermark(5) == -1  # type: ignore[union-attr]
        store.close()
        assert _folders(tmp_path) == ["t8.200", "lease:t8.200"]  # the live holder's stays
        client.close()
    finally:
        for proc in holders.values():
            proc.kill()
            proc.wait(10)


def test_a_finished_microbatch_is_not_revived_by_late_prompt_kv_but_a_rerun_one_is(redis_url) -> None:
    from dejavu_token_worker.runner import FinishedMicrobatch, StageRunner

    class Stage:  # what StageRunner.state asks of a stage
        def allocate_cache(self, batch, max_len):
            from dejavulib.kvcache import KVCache
            from dejavulib.layout import KVLayout

            return KVCache.allocate(KVLayout(1, batch, 1, max_len, 4))

        num_layers = 1

    client = redis.Redis.from_url(redis_url)
    row = RowSpec(request_id="r", prompt_ids=(1,), sampling=SamplingSpec(max_tokens=4, seed=0))
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row,), prompt_len=1, max_len=5).encode())
    runner = StageRunner(Stage(), client, None, 1.0)  # type: ignore[arg-type]
    runner.state(1), runner.state(2)
    runner.release(1)  # finished
    runner.release(2, finished=False)  # its prompt re-runs after a recovery
    with pytest.raises(FinishedMicrobatch):
        runner.state(1)
    assert runner.state(2).spec.mb_id == 2 and set(runner.states) == {2}
    client.close()


def test_the_watermark_is_the_last_contiguous_step_not_the_highest_seen(redis_url, tmp_path) -> None:
    """A decode step's chunk lost on the way leaves a hole: the watermark (what recovery resumes from)
    stays before it until the hole is filled, so a restore never serves the hole as data."""
    client = redis.Redis.from_url(redis_url)
    store = _store(client, tmp_path)
    store.store(*_chunk(0, 3, 0))  # the prompt
    store.store(*_chunk(3, 4, 1))
    assert store.watermark(5) == 1 and client.hget(keys.watermark(1), 5) == b"1"
    store.store(*_chunk(5, 6, 3))  # step 2 lost (or late)
    store.store(*_chunk(6, 7, 4))
    assert store.watermark(5) == 1 and client.hget(keys.watermark(1), 5) == b"1"
    store.store(*_chunk(4, 5, 2))  # the hole filled: everything up to 4 is contiguous
    assert store.watermark(5) == 4 and client.hget(keys.watermark(1), 5) == b"4"
    store.store(*_chunk(8, 9, 6))  # step 5 lost again ...
    store.store(*_chunk(0, 8, 5))  # ... then a whole cache as of step 5 (a restore) covers every step up to 5
    assert store.watermark(5) == 6 and client.hget(keys.watermark(1), 5) == b"6"
    store.drop(5)
    assert store.watermark(5) == -1 and client.hget(keys.watermark(1), 5) is None
    client.close()


def test_a_disk_replica_refuses_what_a_memory_one_would_and_one_unreadable_is_re_run(redis_url, tmp_path) -> None:
    client = redis.Redis.from_url(redis_url)
    store = _store(client, tmp_path, Replication.DISK)
    store.store(*_chunk(0, 3, 0))
    _, step, message = _chunk(199, 201, 1)  # past the microbatch's span (200)
    with pytest.raises(ValueError, match="span"):
        store.store(Region(5, (2, 4), (0, 1), (199, 201)), step, message)
    _, step, message = _chunk(3, 4, 1)
    with pytest.raises(ValueError, match="rows"):
        store.store(Region(5, (2, 4), (1, 2), (3, 4)), step, message)  # a row the microbatch lacks
    assert len(list(store.disk.root.glob("*.kv"))) == 1 and store.watermark(5) == 0  # type: ignore[union-attr]
    store.store(*_chunk(3, 4, 1))
    assert store.watermark(5) == 1
    next(store.disk.root.glob("*.kv")).unlink()  # type: ignore[union-attr]  # a chunk lost on disk
    assert list(store.restorable([5])) == []  # not served: recovery re-runs the prompt instead
    assert store.microbatches() == set() and client.hget(keys.watermark(1), 5) is None
    store.close()
    store.store(*_chunk(0, 3, 0))  # a closed store keeps nothing
    assert store.microbatches() == set() and _folders(tmp_path) == []
    client.close()


def test_memory_accounting_never_waits_for_the_replica_lock(redis_url, tmp_path) -> None:
    """The heartbeat asks what KV is held on its way to renewing the lease: it must not wait behind
    the receiver thread (which may be waiting for a spec, growing a cache or writing to disk)."""
    import threading

    client = redis.Redis.from_url(redis_url)
    store = _store(client, tmp_path, Replication.MEMORY)
    store.store(*_chunk(0, 3, 0))
    got: list[int] = []
    with store.lock:
        t = threading.Thread(target=lambda: got.append(len(store.memory_caches())))
        t.start()
        t.join(timeout=2)
    assert got == [1]
    store.close()
    client.close()
