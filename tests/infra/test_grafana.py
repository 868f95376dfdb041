"""infra/grafana/dejavu.json against what DejaVu really exposes: every panel query names only metrics that
the controller app's GET /metrics or a worker's metrics endpoint serves (names parsed out of the PromQL),
and every exposed family of a worker is on some panel."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import create_app
from dejavu_worker.metrics import (
    Occupancy,
    PassKind,
    PoolUsage,
    Preemption,
    RepairRole,
    StageSnapshot,
    WorkerMetrics,
)
from dejavu_worker.swap import SwapStats
from dejavulib.header import Channel, Header
from tests.controller.conftest import API_KEY, MODEL, ScriptedBackend, build_tokenizer_folder, make_settings

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "dejavu.json"

# The series names a family of each type exposes (prometheus-client also writes *_created for counters and
# histograms).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}  # fmt: skip


def exposed_series(text: str) -> set[str]:
    """Every series name an exposition's families can have, sampled yet or not."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (followed by '('),
    keywords, label names (inside {...} and by/without/on/ignoring/group_*(...)), strings or durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", expr):
        name = match.group(1)
        if name.lower() not in _PROMQL_WORDS:
            names.add(name)
    return names


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel (rows' nested panels too)."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return out


def _worker_exposition() -> str:
    """A token worker's exposition with every figure a worker can have: a stage 0 with a paged pool, replicas,
    swapping and traffic on its data plane."""
    m = WorkerMetrics("t0", "token")
    for kind in PassKind:
        m.observe_pass(kind, 0.01, 4)
    for mode in Preemption:
        m.count_preemption(mode)
    m.restore_seconds.observe(0.5)
    for role in RepairRole:
        m.observe_repair(role, 1.0, ok=True)
    m.observe_repair(RepairRole.SURVIVOR, 1.0, ok=False)
    header = Header(Channel.KV_REPLICA, microbatch=1, step=0, sender="t1")
    m.dataplane.settled("t1", header, 64, 0.001, None)
    m.dataplane.settled("t1", header, 64, 0.001, TimeoutError("late"))
    m.dataplane.received(header)
    m.dataplane.corrupt(Channel.TOKENS)
    snap = StageSnapshot(
        stage=0,
        epoch=2,
        microbatches=3,
        occupancy=Occupancy(4, 2, 1, 1),
        pools={"stage": PoolUsage(10, 100), "replica": PoolUsage(5, 50)},
        host_bytes=0,
        replicas=2,
        replication_lag_steps=1,
        swap=asdict(SwapStats()),
    )
    m.watch(lambda: snap, lambda: {"rejected_stale_epoch": 1})
    return m.render().decode()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def controller_exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The controller app's GET /metrics after one request (its backend a scripted double)."""
    folder = build_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    tokenizer = Tokenizer.from_pretrained(folder)
    app = create_app(make_settings(folder), ScriptedBackend(tokenizer).factory(), tokenizer=tokenizer)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def test_every_panel_query_names_only_metrics_that_are_exposed(dashboard, controller_exposition) -> None:
    exposed = exposed_series(controller_exposition) | exposed_series(_worker_exposition())
    found = queries(dashboard)
    assert len(found) >= 20
    for title, expr in found:
        names = metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        assert names <= exposed, f"panel {title!r} queries metrics nothing exposes: {sorted(names - exposed)}"


def test_every_worker_metric_is_on_some_panel(dashboard) -> None:
    shown = set().union(*(metric_names(expr) for _, expr in queries(dashboard)))
    families = {f.name: f.type for f in text_string_to_metric_families(_worker_exposition())}
    families = {name: kind for name, kind in families.items() if not name.endswith("_created")}  # timestamps
    missing = [name for name, kind in families.items() if not {name + s for s in _SUFFIXES[kind]} & shown]
    assert not missing, f"worker metrics on no panel: {missing}"


def test_the_name_parser_finds_metrics_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, instance) (rate(dejavu_stage_pass_seconds_bucket{kind="decode"}'
        "[$__rate_interval]))) * on (instance) group_left (worker, role) dejavu_worker_info"
    )
    assert metric_names(expr) == {"dejavu_stage_pass_seconds_bucket", "dejavu_worker_info"}
    assert metric_names("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) > bool 1e3") == {"a_total", "b_total"}


def test_the_check_catches_a_misspelt_metric(dashboard, controller_exposition) -> None:
    exposed = exposed_series(controller_exposition) | exposed_series(_worker_exposition())
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(dejavu_request_total[5m]))"  # not dejavu_requests_total
    names = set().union(*(metric_names(expr) for _, expr in queries(broken)))
    assert names - exposed == {"dejavu_request_total"}
