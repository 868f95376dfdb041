"""The status page (/dashboard): who may open it, its snapshot JSON, its server-sent events, its admin actions.

The gateway runs on the scripted backend (in-process, or under a real uvicorn for the event stream); the
actions write to a real Redis, and what they write is checked by the workers' own command verifier.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr

from dejavu_common import keys
from dejavu_common.admin import CommandVerifier, generate_keypair
from dejavu_common.messages import (
    AdminAction,
    AdminCommand,
    StageAssignment,
    Topology,
    WorkerInfo,
    WorkerRole,
    WorkerState,
)
from dejavu_common.private import write_private
from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import create_app
from dejavu_controller.api.auth import key_id
from dejavu_controller.api.guard import basic_password, presented_key
from dejavu_controller.api.metrics import GatewayMetrics
from dejavu_controller.api.routers.dashboard import load_signing_key
from dejavu_controller.api.snapshot import Actions, Feed
from dejavu_controller.api.state import Gateway
from dejavu_controller.overview import Overview, RepairState, RepairView, RequestView
from dejavu_controller.registry import WorkerView

from .conftest import API_KEY, MODEL, LiveServer, ScriptedBackend

ADMIN_KEY = "sk-admin-key-9"
PATHS = ("/dashboard", "/dashboard/snapshot", "/dashboard/events")


def _basic(password: str, user: str = "admin") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def dashboard_settings(
    tokenizer_dir: Path,
    *,
    api_keys: tuple[str, ...] = (API_KEY, ADMIN_KEY),
    admin_key_ids: list[str] | None = None,
    key_file: Path | None = None,
    verify_key: str | None = None,
    redis_url: str = "redis://127.0.0.1:1/0",
) -> Settings:
    ids = [key_id(ADMIN_KEY)] if admin_key_ids is None and ADMIN_KEY in api_keys else admin_key_ids or []
    return Settings(
        model={"name": MODEL, "path": tokenizer_dir},
        engine={"max_context": 256},
        redis={"url": redis_url},
        admin={"verify_key": verify_key},
        controller={
            "host": "127.0.0.1",
            "port": 0,
            "api_keys": [SecretStr(k) for k in api_keys],
            "admin_key_ids": ids,
            "admin_signing_key_file": key_file,
        },
    )


def _worker(worker_id: str, role: WorkerRole, *, spare: bool = False, alive: bool = True, **fields) -> WorkerView:
    info = WorkerInfo(
        worker_id=worker_id, role=role, host="node-a", pid=100, instance=f"{worker_id}-1", data_address="", spare=spare
    )
    return WorkerView(info, alive, fields.pop("state", WorkerState.SERVING), fields.pop("epoch", 3), **fields)


def _topology(epoch: int, token: tuple[str, str]) -> Topology:
    return Topology(
        epoch=epoch,
        mode="disaggregated",
        n_layers=30,
        prompt_stages=(StageAssignment(worker_id="p0", stage=0, layers=(0, 30)),),
        token_stages=(
            StageAssignment(worker_id=token[0], stage=0, layers=(0, 15)),
            StageAssignment(worker_id=token[1], stage=1, layers=(15, 30)),
        ),
        prompt_microbatch=2,
        token_microbatch=2,
    )


def _overview(epoch: int = 3, token: tuple[str, str] = ("t0", "t1"), *, t1_alive: bool = True, repair=None) -> Overview:
    workers = {
        "p0": _worker("p0", WorkerRole.PROMPT, epoch=epoch, seen=epoch),
        "t0": _worker("t0", WorkerRole.TOKEN, epoch=epoch, seen=epoch, kv_bytes=4096, kv_microbatches=2),
        "t1": _worker("t1", WorkerRole.TOKEN, alive=t1_alive, epoch=3, seen=3),
        "spare0": _worker("spare0", WorkerRole.TOKEN, spare=True, state=WorkerState.IDLE, epoch=0, seen=epoch),
    }
    request = RequestView("cmpl-1", "decoding", prompt_tokens=5, generated=7, max_tokens=20, microbatch=11, age_s=1.25)
    return Overview(
        leader=True,
        ready=True,
        topology=_topology(epoch, token),
        workers=workers,
        requests=(request,),
        requests_in_flight=1,
        repair=repair,
    )


@dataclass
class ObservedBackend(ScriptedBackend):
    """The scripted backend, plus an overview the test sets."""

    shown: Overview | None = None

    def overview(self) -> Overview:
        assert self.shown is not None
        return self.shown


@pytest.fixture
def observed(tokenizer: Tokenizer) -> ObservedBackend:
    return ObservedBackend(tokenizer, shown=_overview())


def _app(settings: Settings, backend: ScriptedBackend, tokenizer: Tokenizer):
    return create_app(settings, backend.factory(), tokenizer=tokenizer)


# -- who may ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_without_a_valid_key_the_page_asks_for_one(tokenizer_dir, tokenizer, observed, path):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        for headers in (
            {},
            _bearer("sk-wrong"),
            _basic("sk-wrong"),
            _basic(ADMIN_KEY + "x"),
            {"Authorization": "Basic !!"},
        ):
            response = client.get(path, headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["WWW-Authenticate"].startswith('Basic realm="DejaVu dashboard"')
            assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", PATHS)
def test_a_key_without_the_admin_role_is_forbidden(tokenizer_dir, tokenizer, observed, path):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        for headers in (_bearer(API_KEY), _basic(API_KEY)):
            response = client.get(path, headers=headers)
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "admin_required"
        response = client.post(
            "/dashboard/actions", json={"worker_id": "t1", "action": "kill"}, headers=_bearer(API_KEY)
        )
        assert response.status_code == 403


def test_keys_configured_but_no_admin_role_forbid_everyone(tokenizer_dir, tokenizer, observed):
    settings = dashboard_settings(tokenizer_dir, api_keys=(API_KEY,))
    with TestClient(_app(settings, observed, tokenizer)) as client:
        assert client.get("/dashboard/snapshot", headers=_bearer(API_KEY)).status_code == 403


def test_the_admin_key_opens_the_page_as_bearer_or_basic_password(tokenizer_dir, tokenizer, observed):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        for headers in (_bearer(ADMIN_KEY), _basic(ADMIN_KEY), _basic(ADMIN_KEY, user="")):
            response = client.get("/dashboard", headers=headers)
            assert response.status_code == 200, headers
            assert response.headers["content-type"].startswith("text/html")
        # Basic auth is the browser's way onto the page only: the API still takes bearer keys alone.
        assert client.get("/v1/models", headers=_basic(ADMIN_KEY)).status_code == 401
        assert client.get("/metrics", headers=_basic(ADMIN_KEY)).status_code == 401


def test_the_page_allows_its_own_inline_script_and_style_only(tokenizer_dir, tokenizer, observed):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        response = client.get("/dashboard", headers=_bearer(ADMIN_KEY))
    policy = response.headers["Content-Security-Policy"]
    (script,) = re.findall(r"<script>(.*?)</script>", response.text, flags=re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy
    assert "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    assert "dashboard/events" in script and "dashboard/actions" in script


def test_the_page_is_not_part_of_the_openai_schema(tokenizer_dir, tokenizer, observed):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        paths = client.get("/openapi.json", headers=_bearer(API_KEY)).json()["paths"]
    assert paths and not [path for path in paths if path.startswith("/dashboard")]


def test_without_api_keys_the_page_is_open_like_the_loopback_api(tokenizer_dir, tokenizer, observed):
    with TestClient(_app(dashboard_settings(tokenizer_dir, api_keys=()), observed, tokenizer)) as client:
        assert client.get("/dashboard/snapshot").status_code == 200


def test_admin_key_ids_must_name_configured_keys(tokenizer_dir, tokenizer, observed):
    with pytest.raises(ValueError, match="admin_key_ids names no configured API key: 000000000000"):
        _app(dashboard_settings(tokenizer_dir, admin_key_ids=["000000000000"]), observed, tokenizer)
    with pytest.raises(ValueError, match="admin_key_ids"):
        _app(dashboard_settings(tokenizer_dir, api_keys=(), admin_key_ids=[key_id(ADMIN_KEY)]), observed, tokenizer)


@pytest.mark.parametrize(
    ("header", "password"),
    [
        (None, None),
        ("Basic " + base64.b64encode(b"u:p@ss:word").decode(), "p@ss:word"),
        ("basic " + base64.b64encode(b":key").decode(), "key"),
        ("Basic " + base64.b64encode(b"user-only").decode(), None),
        ("Basic " + base64.b64encode(b"user:").decode(), None),
        ("Basic not-base64!", None),
        ("Basic " + base64.b64encode(b"u:\xff").decode(), None),
        ("Bearer abc", None),
    ],
)
def test_basic_password(header, password):
    assert basic_password(header) == password


def test_only_the_dashboard_takes_a_basic_password():
    basic = "Basic " + base64.b64encode(b"u:k").decode()
    assert presented_key("/dashboard", basic) == "k"
    assert presented_key("/dashboard/events", basic) == "k"
    assert presented_key("/dashboardx", basic) is None
    assert presented_key("/v1/models", basic) is None
    assert presented_key("/v1/models", "Bearer k") == "k"


# -- the snapshot -------------------------------------------------------------------------------------


def test_the_snapshot_shows_topology_workers_requests_and_repair(tokenizer_dir, tokenizer, observed):
    repair = RepairView(
        epoch=4,
        replaced={1: "spare0"},
        resumable=(11,),
        rerun=(12,),
        dropped=(),
        state=RepairState.RUNNING,
        seconds=0.5,
        phases={"replacement_assigned": 0.01},
    )
    observed.shown = _overview(t1_alive=False, repair=repair)
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer)) as client:
        snap = client.get("/dashboard/snapshot", headers=_bearer(ADMIN_KEY)).json()
    assert snap["model"] == MODEL
    assert snap["topology"] == {
        "epoch": 3,
        "mode": "disaggregated",
        "n_layers": 30,
        "prompt": [{"stage": 0, "worker": "p0", "layers": [0, 30]}],
        "token": [{"stage": 0, "worker": "t0", "layers": [0, 15]}, {"stage": 1, "worker": "t1", "layers": [15, 30]}],
    }
    workers = {w["id"]: w for w in snap["workers"]}
    assert list(workers) == ["p0", "spare0", "t0", "t1"]
    assert workers["t0"] == {
        "id": "t0",
        "role": "token",
        "spare": False,
        "stage": "token 0",
        "alive": True,
        "state": "serving",
        "epoch": 3,
        "seen": 3,
        "kv_bytes": 4096,
        "kv_microbatches": 2,
        "host": "node-a",
        "pid": 100,
    }
    assert workers["t1"]["alive"] is False and workers["t1"]["stage"] == "token 1"
    assert workers["spare0"]["stage"] is None and workers["spare0"]["spare"] is True
    assert workers["p0"]["stage"] == "prompt 0"
    assert snap["requests"] == {
        "in_flight": 1,
        "shown": [
            {
                "id": "cmpl-1",
                "status": "decoding",
                "prompt_tokens": 5,
                "generated": 7,
                "max_tokens": 20,
                "microbatch": 11,
                "age_s": 1.25,
            }
        ],
    }
    assert snap["repair"] == {
        "epoch": 4,
        "state": "running",
        "replaced": {"1": "spare0"},
        "resumable": [11],
        "rerun": [12],
        "dropped": [],
        "seconds": 0.5,
        "phases": {"replacement_assigned": 0.01},
    }
    assert snap["controller"]["leader"] is True and snap["controller"]["ready"] is True
    assert snap["events"] == [] and snap["watching_since"] == pytest.approx(snap["time"])


def test_the_snapshot_counts_what_the_gateway_served(tokenizer_dir, tokenizer, backend):
    with TestClient(_app(dashboard_settings(tokenizer_dir), backend, tokenizer)) as client:
        for _ in range(2):
            response = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, headers=_bearer(API_KEY)
            )
            assert response.status_code == 200
        usage = response.json()["usage"]
        snap = client.get("/dashboard/snapshot", headers=_bearer(ADMIN_KEY)).json()
    counters = snap["controller"]["counters"]
    assert counters["requests"]["length"] == 2 and counters["generated_tokens"] == 2 * usage["completion_tokens"]
    assert counters["prompt_tokens"] == 2 * usage["prompt_tokens"]
    assert counters["kv_bytes_streamed"]["prompt_to_token"] == 2 * 4 * backend.kv_bytes_per_token
    assert snap["controller"]["in_flight"] == 0
    # A backend without an overview: its stats' worker states alone.
    assert snap["topology"] is None and snap["repair"] is None
    assert snap["workers"] == [{"id": "prompt-0", "state": "serving"}, {"id": "token-0", "state": "serving"}]
    assert snap["requests"] == {"in_flight": None, "shown": []}


def test_the_event_log_follows_a_repair(tokenizer_dir, tokenizer, observed):
    """Epoch 3 (t0, t1) -> t1's lease expires -> epoch 4 with spare0 in stage 1, a repair runs, then ends."""
    settings = dashboard_settings(tokenizer_dir)
    gateway = Gateway(settings, observed, tokenizer, GatewayMetrics(), 0)
    clock = iter(range(1000, 2000)).__next__
    feed = Feed(lambda: Actions(False, "off", 60.0), clock=lambda: float(clock()), min_age_s=0.0)

    def events() -> list[tuple[str, str]]:
        return [(e["kind"], e["message"]) for e in feed.snapshot(gateway)["events"]]

    assert events() == []
    observed.shown = _overview(t1_alive=False)
    assert events() == [("lease", "t1's lease expired")]

    def repair(state: RepairState, seconds: float) -> RepairView:
        return RepairView(4, {1: "spare0"}, (11,), (), (), state, seconds, {})

    observed.shown = _overview(4, ("t0", "spare0"), t1_alive=False, repair=repair(RepairState.RUNNING, 0.1))
    assert events()[1:] == [
        ("topology", "topology epoch 4 published: token 1 t1 -> spare0"),
        ("repair", "repair to epoch 4 started (token 1 -> spare0): resuming microbatches [11], re-running []"),
    ]
    observed.shown = _overview(4, ("t0", "spare0"), t1_alive=False, repair=repair(RepairState.DONE, 1.5))
    shown = observed.shown
    observed.shown = Overview(**{**shown.__dict__, "ready": False, "workers": {**shown.workers}})
    observed.shown.workers.pop("t1")
    assert events()[3:] == [
        ("lease", "t1 left the registry"),
        ("repair", "repair to epoch 4 done in 1.50 s (token 1 -> spare0)"),
    ]
    feed.record("action", "kill sent to t1")
    snap = feed.snapshot(gateway)
    assert snap["events"][-1]["message"] == "kill sent to t1" and snap["watching_since"] == 1000.0


# -- server-sent events -------------------------------------------------------------------------------


def test_the_event_stream_sends_a_snapshot_every_second(tokenizer_dir, observed):
    server = LiveServer(dashboard_settings(tokenizer_dir), observed)
    server.start()
    try:
        with httpx.stream("GET", server.url + "/dashboard/events", headers=_bearer(ADMIN_KEY), timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            blocks: list[str] = []
            buffer = ""
            for text in response.iter_text():
                buffer += text
                *done, buffer = buffer.split("\n\n")
                blocks.extend(done)
                if len(blocks) >= 3:
                    break
    finally:
        server.stop()
    assert blocks[0] == "retry: 2000"
    for sequence, block in enumerate(blocks[1:3], start=1):
        event, event_id, data = block.split("\n")
        assert event == "event: snapshot" and event_id == f"id: {sequence}"
        snap = json.loads(data.removeprefix("data: "))
        assert snap["topology"]["epoch"] == 3 and snap["controller"]["ready"] is True


# -- admin actions ------------------------------------------------------------------------------------


@pytest.fixture
def keypair() -> tuple[str, str]:
    return generate_keypair()


@pytest.fixture
def key_file(tmp_path, keypair) -> Path:
    path = tmp_path / "admin.env"
    write_private(path, f"# dejavu up\nDEJAVU_ADMIN__SIGNING_KEY={keypair[0]}\n")
    return path


def _register(client: redis.Redis, worker_id: str, instance: str) -> None:
    info = WorkerInfo(worker_id=worker_id, role=WorkerRole.TOKEN, host="h", pid=1, instance=instance, data_address="")
    client.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving"})
    client.sadd(keys.WORKERS, worker_id)


def _commands(client: redis.Redis) -> list[AdminCommand]:
    return [AdminCommand.decode(fields[b"cmd"]) for _, fields in client.xrange(keys.ADMIN_STREAM)]


def test_an_action_is_a_signed_command_the_worker_obeys(
    tokenizer_dir, tokenizer, observed, redis_url, key_file, keypair
):
    client = redis.Redis.from_url(redis_url)
    _register(client, "t1", "t1-instance-7")
    settings = dashboard_settings(tokenizer_dir, key_file=key_file, verify_key=keypair[1], redis_url=redis_url)
    with TestClient(_app(settings, observed, tokenizer), headers=_bearer(ADMIN_KEY)) as api:
        assert api.get("/dashboard/snapshot").json()["actions"] == {
            "enabled": True,
            "reason": None,
            "max_pause_s": settings.admin.max_pause_s,
        }
        kill = api.post("/dashboard/actions", json={"worker_id": "t1", "action": "kill"})
        pause = api.post("/dashboard/actions", json={"worker_id": "t1", "action": "pause-heartbeats", "seconds": 4})
        assert kill.status_code == 200 and pause.status_code == 200, (kill.text, pause.text)
        snap = api.get("/dashboard/snapshot").json()
    sent = _commands(client)
    assert [(c.action, c.seconds, c.instance) for c in sent] == [
        (AdminAction.KILL, 0.0, "t1-instance-7"),
        (AdminAction.PAUSE_HEARTBEATS, 4.0, "t1-instance-7"),
    ]
    assert kill.json()["command_id"] == sent[0].command_id and pause.json()["seconds"] == 4.0
    verifier = CommandVerifier(
        keypair[1],
        "t1",
        "t1-instance-7",
        max_ttl_s=settings.admin.command_ttl_s,
        max_pause_s=settings.admin.max_pause_s,
        clock_skew_s=settings.admin.clock_skew_s,
    )
    for command in sent:
        verifier.check(command)  # raises AdminRejected unless the worker would carry it out
    messages = [e["message"] for e in snap["events"] if e["kind"] == "action"]
    assert messages == [
        f"kill sent to t1 (command {sent[0].command_id[:8]})",
        f"pause-heartbeats 4 s sent to t1 (command {sent[1].command_id[:8]})",
    ]


def test_bad_actions_are_refused_and_send_nothing(tokenizer_dir, tokenizer, observed, redis_url, key_file, keypair):
    client = redis.Redis.from_url(redis_url)
    _register(client, "t1", "i")
    settings = dashboard_settings(tokenizer_dir, key_file=key_file, verify_key=keypair[1], redis_url=redis_url)
    with TestClient(_app(settings, observed, tokenizer), headers=_bearer(ADMIN_KEY)) as api:
        cases = [
            ({"worker_id": "t1", "action": "pause-heartbeats"}, {}, 400, None),
            ({"worker_id": "t1", "action": "pause-heartbeats", "seconds": 1e6}, {}, 400, None),
            ({"worker_id": "t1", "action": "kill", "seconds": 3}, {}, 400, None),
            ({"worker_id": "t1", "action": "explode"}, {}, 400, None),
            ({"worker_id": "t1", "action": "kill", "extra": 1}, {}, 400, None),
            ({"worker_id": "nobody", "action": "kill"}, {}, 404, "worker_not_found"),
            ({"worker_id": "t1", "action": "kill"}, {"Origin": "https://evil.example"}, 403, "cross_origin"),
        ]
        for body, headers, status, code in cases:
            response = api.post("/dashboard/actions", json=body, headers=headers)
            assert response.status_code == status, (body, response.text)
            assert code is None or response.json()["error"]["code"] == code
        same_origin = api.post(
            "/dashboard/actions", json={"worker_id": "t1", "action": "drain"}, headers={"Origin": "http://testserver"}
        )
        assert same_origin.status_code == 200
    assert [c.action for c in _commands(client)] == [AdminAction.DRAIN]


def test_without_a_signing_key_file_actions_are_disabled_with_the_reason(tokenizer_dir, tokenizer, observed):
    with TestClient(_app(dashboard_settings(tokenizer_dir), observed, tokenizer), headers=_bearer(ADMIN_KEY)) as api:
        actions = api.get("/dashboard/snapshot").json()["actions"]
        response = api.post("/dashboard/actions", json={"worker_id": "t1", "action": "kill"})
    assert actions["enabled"] is False and "DEJAVU_CONTROLLER__ADMIN_SIGNING_KEY_FILE" in actions["reason"]
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_actions_disabled"


def test_the_signing_key_file_is_checked_at_startup(tmp_path, tokenizer_dir, tokenizer, observed, keypair):
    signing, verify = keypair
    alone = tmp_path / "alone"
    write_private(alone, signing + "\n")
    assert load_signing_key(alone) == signing
    shared = tmp_path / "shared"
    shared.write_text(signing)
    shared.chmod(0o644)
    bad = tmp_path / "bad"
    write_private(bad, "DEJAVU_ADMIN__SIGNING_KEY=not-a-key\n")
    two = tmp_path / "two"
    write_private(two, f"{signing}\n{signing}\n")
    for path, message in (
        (shared, "open to group or others"),
        (bad, "not base64"),
        (two, "must hold one key"),
        (tmp_path / "missing", "does not exist"),
    ):
        with pytest.raises(ValueError, match=message):
            _app(dashboard_settings(tokenizer_dir, key_file=path), observed, tokenizer)
    other_verify = generate_keypair()[1]
    with pytest.raises(ValueError, match=r"does not match admin\.verify_key"):
        _app(dashboard_settings(tokenizer_dir, key_file=alone, verify_key=other_verify), observed, tokenizer)
    _app(dashboard_settings(tokenizer_dir, key_file=alone, verify_key=verify), observed, tokenizer)


def test_redis_errors_answer_503(tokenizer_dir, tokenizer, observed, key_file):
    settings = dashboard_settings(tokenizer_dir, key_file=key_file)  # redis://127.0.0.1:1: nothing listens
    settings.redis.retries = 0
    with TestClient(_app(settings, observed, tokenizer), headers=_bearer(ADMIN_KEY)) as api:
        response = api.post("/dashboard/actions", json={"worker_id": "t1", "action": "kill"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "redis_unavailable"
