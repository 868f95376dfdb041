"""A worker's Prometheus metrics (dejavu_worker.metrics): what the recorders and the scrape-time snapshot
expose, parsed back with prometheus-client's own parser; the data plane's traffic counted over DejaVuLib's
in-process transport; the HTTP endpoint on a free port; the URL published in the registry record."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from dejavu_common.messages import WorkerInfo, WorkerRole
from dejavu_common.settings import Settings, TransportSettings
from dejavu_worker.endpoint import DataEndpoint
from dejavu_worker.metrics import (
    Occupancy,
    PassKind,
    PoolUsage,
    Preemption,
    RepairRole,
    StageSnapshot,
    WorkerMetrics,
    metrics_url,
)
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout
from tests.dejavulib.fake_transport import FakeTransport
from tests.worker.records import register


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def families(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def _wait(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_a_pass_is_one_observation_of_its_seconds_and_tokens_by_kind() -> None:
    m = WorkerMetrics("t0", "token")
    m.observe_pass(PassKind.DECODE, 0.003, 8)
    m.observe_pass(PassKind.DECODE, 0.004, 6)
    m.observe_pass(PassKind.PREFILL, 0.2, 300)
    s = samples(m.render())
    assert s[("dejavu_stage_pass_seconds_count", (("kind", "decode"),))] == 2
    assert s[("dejavu_stage_pass_seconds_sum", (("kind", "decode"),))] == pytest.approx(0.007)
    assert s[("dejavu_stage_pass_tokens_sum", (("kind", "decode"),))] == 14
    assert s[("dejavu_stage_pass_tokens_sum", (("kind", "prefill"),))] == 300
    # Buckets are cumulative: 300 tokens fall in le=512, not in le=256.
    assert s[("dejavu_stage_pass_tokens_bucket", (("kind", "prefill"), ("le", "256.0")))] == 0
    assert s[("dejavu_stage_pass_tokens_bucket", (("kind", "prefill"), ("le", "512.0")))] == 1


def test_preemptions_and_repairs_are_counted_by_mode_role_and_outcome() -> None:
    m = WorkerMetrics("t0", "token")
    m.count_preemption(Preemption.SWAP)
    m.count_preemption(Preemption.SWAP)
    m.count_preemption(Preemption.RECOMPUTE)
    m.observe_repair(RepairRole.REPLACEMENT, 1.5, ok=True)
    m.observe_repair(RepairRole.SURVIVOR, 9.0, ok=False)  # a failed repair: counted, its time not observed
    s = samples(m.render())
    assert s[("dejavu_preemptions_total", (("mode", "swap"),))] == 2
    assert s[("dejavu_preemptions_total", (("mode", "recompute"),))] == 1
    assert s[("dejavu_repair_seconds_sum", (("role", "replacement"),))] == 1.5
    assert s[("dejavu_repairs_total", (("outcome", "ok"),))] == 1
    assert s[("dejavu_repairs_total", (("outcome", "failed"),))] == 1
    assert ("dejavu_repair_seconds_count", (("role", "survivor"),)) not in s


def test_the_snapshot_is_read_at_each_scrape_and_what_a_worker_lacks_is_left_out() -> None:
    m = WorkerMetrics("t1", "token")
    text = m.render()
    s = samples(text)
    assert s[("dejavu_worker_info", (("role", "token"), ("worker", "t1")))] == 1
    assert s[("dejavu_stage_index", ())] == -1  # no stage yet
    absent = {"dejavu_kv_pool_usage_ratio", "dejavu_stage_running_rows", "dejavu_replication_lag_steps"}
    assert not absent & families(text)  # never a placeholder 0

    snap = StageSnapshot(
        stage=0,
        epoch=3,
        microbatches=5,
        occupancy=Occupancy(running_rows=7, running_microbatches=2, waiting_rows=4, waiting_microbatches=1),
        pools={"stage": PoolUsage(used=30, capacity=120), "replica": PoolUsage(used=0, capacity=64)},
        host_bytes=4096,
        replicas=2,
        replication_lag_steps=3,
        swap=None,
    )
    m.watch(lambda: snap, lambda: {"rejected_stale_epoch": 2, "delivered": 10, "integrity_errors": 1})
    s = samples(m.render())
    assert s[("dejavu_stage_index", ())] == 0 and s[("dejavu_stage_epoch", ())] == 3
    assert s[("dejavu_stage_running_rows", ())] == 7 and s[("dejavu_stage_waiting_microbatches", ())] == 1
    assert s[("dejavu_kv_pool_used_blocks", (("pool", "stage"),))] == 30
    assert s[("dejavu_kv_pool_free_blocks", (("pool", "stage"),))] == 90
    assert s[("dejavu_kv_pool_usage_ratio", (("pool", "stage"),))] == 0.25
    assert s[("dejavu_kv_pool_usage_ratio", (("pool", "replica"),))] == 0.0
    assert s[("dejavu_kv_host_bytes", ())] == 4096 and s[("dejavu_replication_lag_steps", ())] == 3
    # The endpoint's refusals by reason; its delivered count and MAC failures are not refusals.
    assert s[("dejavu_dataplane_rejected_messages_total", (("reason", "stale_epoch"),))] == 2
    assert not [k for k in s if k[0] == "dejavu_dataplane_rejected_messages_total" and "delivered" in str(k)]


def test_swap_counters_come_from_the_swap_managers_stats() -> None:
    from dataclasses import asdict

    from dejavu_worker.swap import SwapStats

    m = WorkerMetrics("t0", "token")
    stats = SwapStats(swap_ins=3, swap_in_bytes=300, swap_outs=2, swap_out_bytes=200, acquire_wait_s=0.5)
    m.watch(lambda: StageSnapshot(stage=0, swap=asdict(stats)), dict)
    s = samples(m.render())
    assert s[("dejavu_swap_bytes_total", (("direction", "in"),))] == 300
    assert s[("dejavu_swaps_total", (("direction", "out"),))] == 2
    assert s[("dejavu_swap_wait_seconds_total", ())] == 0.5


def test_two_workers_in_one_process_keep_their_own_registries() -> None:
    a, b = WorkerMetrics("t0", "token"), WorkerMetrics("t1", "token")
    a.observe_pass(PassKind.DECODE, 0.01, 4)
    key = ("dejavu_stage_pass_seconds_count", (("kind", "decode"),))
    assert samples(a.render())[key] == 1 and samples(b.render())[key] == 0


def test_the_metrics_are_served_over_http_on_a_free_port_until_closed() -> None:
    m = WorkerMetrics("p0", "prompt")
    m.observe_pass(PassKind.PREFILL, 0.05, 40)
    port = m.serve("127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read()
        s = samples(body)
        assert s[("dejavu_stage_pass_tokens_sum", (("kind", "prefill"),))] == 40
        assert s[("dejavu_worker_info", (("role", "prompt"), ("worker", "p0")))] == 1
    finally:
        m.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    m.close()  # twice, and before serving: harmless


def test_the_published_url_names_the_advertised_host_when_bound_to_a_wildcard() -> None:
    assert metrics_url("127.0.0.1", "10.0.0.5", 9400) == "http://127.0.0.1:9400/metrics"
    assert metrics_url("0.0.0.0", "10.0.0.5", 9400) == "http://10.0.0.5:9400/metrics"
    assert metrics_url("::", "fd00::7", 9400) == "http://[fd00::7]:9400/metrics"
    assert metrics_url("0.0.0.0", "token-worker-0", 9400) == "http://token-worker-0:9400/metrics"


def test_the_registry_record_carries_the_url_and_an_old_record_still_reads() -> None:
    info = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="i", data_address="")
    assert b"metrics_url" not in info.encode()  # None: the record reads as before the field existed
    old = b'{"v":1,"worker_id":"t0","role":"token","host":"h","pid":1,"instance":"i","data_address":""}'
    assert WorkerInfo.decode(old).metrics_url is None
    served = info.model_copy(update={"metrics_url": "http://h:9400/metrics"})
    assert WorkerInfo.decode(served.encode()) == served


def test_the_port_setting_defaults_to_off_and_reads_from_the_environment(monkeypatch) -> None:
    assert Settings().worker.metrics_port is None
    monkeypatch.setenv("DEJAVU_WORKER__METRICS_PORT", "0")
    monkeypatch.setenv("DEJAVU_WORKER__METRICS_HOST", "0.0.0.0")
    settings = Settings()
    assert settings.worker.metrics_port == 0 and settings.worker.metrics_host == "0.0.0.0"
    monkeypatch.setenv("DEJAVU_WORKER__METRICS_PORT", "70000")
    with pytest.raises(ValueError, match="metrics_port"):
        Settings()


# -- the data plane -------------------------------------------------------------------------------------


class FlakyLink(FakeTransport):
    """Flips one payload byte of the next ``corrupt`` messages it sends, after they were sealed; with ``hold``,
    delivers what it sends but keeps the sends pending (in ``held``) until the test completes them."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self.corrupt = 0
        self.hold = False
        self.held: list[Handle] = []

    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        if self.corrupt > 0 and payload.nbytes:
            self.corrupt -= 1
            payload = payload.copy()
            payload[payload.nbytes // 2] ^= 0x40
        handle = super().send_message(peer_id, header, payload)
        if not self.hold:
            return handle
        self.held.append(Handle(payload.nbytes))
        return self.held[-1]


@pytest.fixture
def link(redis_url) -> Iterator[tuple[DataEndpoint, DataEndpoint, FlakyLink, WorkerMetrics, WorkerMetrics]]:
    """Worker t0's endpoint connected to t1's (through t1's registry record), each counting in its metrics."""
    client = redis.Redis.from_url(redis_url)
    flaky = FlakyLink("t0")
    sender = DataEndpoint(TransportSettings(), "t0", transport=flaky)
    receiver = DataEndpoint(TransportSettings(), "t1", transport=FakeTransport("t1"), registry=client)
    sent, got = WorkerMetrics("t0", "token"), WorkerMetrics("t1", "token")
    sender.record_to(sent.dataplane)
    receiver.record_to(got.dataplane)
    register(client, sender)
    register(client, receiver)
    sender.connect_all(client, ["t1"])
    yield sender, receiver, flaky, sent, got
    sender.close()
    receiver.close()
    client.close()


def test_data_plane_bytes_latency_and_corrupt_payloads_per_peer_and_channel(link) -> None:
    sender, receiver, flaky, sent, got = link
    sender.send("t1", Channel.ACTIVATION, b"x" * 100)
    assert receiver.recv(Channel.ACTIVATION, timeout_s=5) is not None
    _wait(lambda: samples(sent.render()).get(("dejavu_dataplane_send_seconds_count", (("channel", "ACTIVATION"),
                                                                                        ("peer", "t1")))))  # fmt: skip
    s = samples(sent.render())
    assert s[("dejavu_dataplane_sent_bytes_total", (("channel", "ACTIVATION"), ("peer", "t1")))] == 100
    r = samples(got.render())
    assert r[("dejavu_dataplane_received_bytes_total", (("channel", "ACTIVATION"), ("peer", "t0")))] == 100

    flaky.corrupt = 1
    sender.send("t1", Channel.TOKENS, b"bad" * 10)
    sender.send("t1", Channel.TOKENS, b"good")
    assert bytes(receiver.recv(Channel.TOKENS, timeout_s=5)) == b"good"
    r = samples(got.render())
    assert r[("dejavu_dataplane_corrupt_payloads_total", (("channel", "TOKENS"),))] == 1
    assert receiver.corrupt["TOKENS"] == 1


def test_replica_bytes_count_as_lag_until_their_send_settles(link) -> None:
    sender, receiver, flaky, sent, _got = link
    layout = KVLayout(2, 1, 1, 8, 4)
    cache = KVCache.allocate(layout, "cpu")
    region = layout.region(positions=(0, 4), microbatch=1)

    def lag() -> float:
        return samples(sent.render())[("dejavu_replication_lag_bytes", ())]

    flaky.hold = True  # the transport has not completed the sends yet
    for step in (0, 1):
        sender.send_region("t1", Header(Channel.KV_REPLICA, microbatch=1, step=step), cache, region)
    _wait(lambda: len(flaky.held) == 2)
    assert lag() == 2 * region.nbytes(layout)
    assert receiver.recv_message(Channel.KV_REPLICA, timeout_s=5) is not None
    flaky.held[0].set_done()
    _wait(lambda: lag() == region.nbytes(layout))
    flaky.held[1].set_done(TimeoutError("lost"))  # a failed send is no longer in flight either
    _wait(lambda: lag() == 0)
    failures = samples(sent.render())[
        ("dejavu_dataplane_send_failures_total", (("channel", "KV_REPLICA"), ("peer", "t1")))
    ]
    assert failures == 1
