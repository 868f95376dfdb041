"""The container deployment end to end: `make images`, `make deploy-compose`, requests, a crash, teardown.

Everything goes through the documented commands (docs/deployment.md) with BASE=local, so it runs on a
host that reaches Debian's mirror and PyPI but no container registry (such as CI's). Requests go through
the official ``openai`` client with the deployment's API key, and every greedy output is compared with
the in-process engine's (tests/system/reference.py). A token-worker container is then killed while the
requests stream: the spare container takes its stage over and every stream must stay exact. Last, the
project's containers, network and volume are removed and checked gone.

The Docker engine is the one running, or a ``dockerd`` this test starts and stops (tests/infra/docker_host.py).
Images and the local base stay in Docker's store as the cache of the next run; only this run's
containers, network, volume and credentials are removed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from openai import OpenAI

from dejavu_common import keys
from dejavu_common.messages import Topology
from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from tests.system.reference import Reference

from .conftest import REPO, read_env_file
from .docker_host import DockerDaemon

pytestmark = [pytest.mark.docker, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 24
MODEL = "SmolLM2-135M-Instruct"
# Stable tags for this test's builds: repeated runs overwrite them instead of piling up one per commit.
GIT_REV = "e2e"
WORKER_SERVICES = ("prompt-worker-0", "prompt-worker-1", "token-worker-0", "token-worker-1", "token-worker-spare")
SERVICES = ("redis", "controller", *WORKER_SERVICES)
BUILD_TIMEOUT_S = 1800
READY_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run a command in the repository; its output on success, an assertion with its tail otherwise."""
    result = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(args)} failed ({result.returncode}):\n{output[-6000:]}"
    return output


class Deployment:
    """One Compose project deployed with `make deploy-compose BASE=local` on free ports."""

    def __init__(self, workdir: Path) -> None:
        self.project = f"dejavu-e2e-{os.getpid()}"
        self.secrets_file = workdir / "secrets.env"
        self.controller_port, self.redis_port = free_port(), free_port()
        self.make_vars = [
            "BASE=local",
            f"GIT_REV={GIT_REV}",
            f"COMPOSE_PROJECT={self.project}",
            f"SECRETS_ENV={self.secrets_file}",
        ]
        self.env = {**os.environ, "CONTROLLER_PORT": str(self.controller_port), "REDIS_PORT": str(self.redis_port)}

    @property
    def secrets(self) -> dict[str, str]:
        return read_env_file(self.secrets_file)

    @property
    def api_key(self) -> str:
        return json.loads(self.secrets["CONTROLLER_API_KEYS"])[0]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.controller_port}"

    def up(self) -> None:
        run(["make", "-s", "deploy-compose", *self.make_vars], 600, self.env)

    def down(self) -> str:
        return run(["make", "-s", "down-compose", *self.make_vars, "DOWN_FLAGS=-v --remove-orphans"], 300, self.env)

    def container(self, service: str) -> str:
        """The id of the service's (only) container, running or not."""
        out = subprocess.run(
            ["docker", "ps", "-aq", *self._filters(), "--filter", f"label=com.docker.compose.service={service}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def inspect(self, service: str, template: str) -> str:
        args = ["docker", "inspect", "-f", template, self.container(service)]
        return subprocess.run(args, capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    def exec(self, service: str, *command: str) -> str:
        args = ["docker", "exec", self.container(service), *command]
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    def logs(self, tail: int = 60) -> str:
        parts = []
        for service in SERVICES:
            try:
                cid = self.container(service)
            except (AssertionError, subprocess.CalledProcessError):
                continue
            out = subprocess.run(
                ["docker", "logs", "--tail", str(tail), cid], capture_output=True, text=True, timeout=30
            )
            parts.append(f"--- {service}\n{out.stdout}{out.stderr}")
        return "\n".join(parts)

    def leftovers(self) -> dict[str, list[str]]:
        """This project's containers, networks and volumes that still exist."""
        found = {}
        for kind in ("container", "network", "volume"):
            args = ["docker", kind, "ls", "-q", *self._filters()]
            if kind == "container":
                args.insert(3, "-a")
            found[kind] = subprocess.run(args, capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return found

    def redis_admin(self) -> redis.Redis:
        """Redis on its loopback port, as the read-mostly admin user (what `dejavu admin status` uses)."""
        return redis.Redis(
            port=self.redis_port, username="admin", password=self.secrets["REDIS_PASSWORD_ADMIN"], socket_timeout=10
        )

    def _filters(self) -> list[str]:
        return ["--filter", f"label=com.docker.compose.project={self.project}"]


def wait_until(what: str, check, timeout_s: float, deployment: Deployment, interval_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{deployment.logs()}")


def ready(deployment: Deployment) -> bool:
    import httpx

    try:
        return httpx.get(deployment.api_url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Round:
    """Stream every prompt concurrently; records when each chunk arrived."""

    def __init__(self, client: OpenAI) -> None:
        self.client = client
        self.texts: dict[str, str] = {}
        self.errors: list[BaseException] = []
        self.arrivals: list[float] = []
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._one, args=(p,), daemon=True) for p in PROMPTS]
        for t in self.threads:
            t.start()

    def _one(self, prompt: str) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            parts = []
            for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                with self.cond:
                    self.arrivals.append(time.monotonic())
                    self.cond.notify_all()
            self.texts[prompt] = "".join(parts)
        except BaseException as exc:  # recorded and asserted by the test
            self.errors.append(exc)

    def wait_chunks(self, n: int, timeout_s: float = 180) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.arrivals) >= n, timeout_s), "requests made no progress"

    def finish(self, timeout_s: float = 300, deployment: Deployment | None = None) -> dict[str, str]:
        logs = (lambda: deployment.logs(tail=200)) if deployment is not None else (lambda: "")
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), f"a request hung\n{logs()}"
        assert not self.errors, f"{self.errors}\n{logs()}"
        return self.texts


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[None]:
    daemon = DockerDaemon()
    reason = daemon.why_not()
    if reason is not None:
        pytest.skip(f"container deployment not tested: {reason}")
    try:
        yield
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def images(docker_engine: None) -> dict[str, float]:
    """`make images BASE=local` (the local base, the wheelhouse, five builds); its duration in seconds."""
    if os.geteuid() != 0:
        pytest.skip("container deployment not tested: `make local-base` runs debootstrap, which needs root")
    started = time.monotonic()
    output = run(["make", "-s", "images", "BASE=local", f"GIT_REV={GIT_REV}"], BUILD_TIMEOUT_S)
    sizes = dict(re.findall(r"^(dejavu-[a-z-]+:\S+) (\S+)$", output, re.M))
    print(f"\nmake images BASE=local: {time.monotonic() - started:.0f} s; sizes {sizes}")
    return {"seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def deployment(images: dict[str, float], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("compose"))
    try:
        started = time.monotonic()
        deployment.up()
        wait_until("GET /ready answers 200", lambda: ready(deployment), READY_TIMEOUT_S, deployment)
        print(f"\ndeploy-compose to /ready: {time.monotonic() - started:.0f} s")
        yield deployment
    finally:
        deployment.down()
        left = deployment.leftovers()
        deployment.secrets_file.unlink(missing_ok=True)
        assert left == {"container": [], "network": [], "volume": []}, left


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    ref = Reference(ensure_default_model(Settings()))
    return {p: ref.text(p, MAX_TOKENS) for p in PROMPTS}


def holder(client: redis.Redis, stage: int) -> str:
    """The worker id holding token stage ``stage`` in the published topology."""
    return Topology.decode(client.get(keys.TOPOLOGY)).token_stages[stage].worker_id


def test_images_run_as_non_root_and_their_health_checks_pass(deployment: Deployment) -> None:
    """Every service container turns healthy through its image's HEALTHCHECK (the controller's /health,
    the workers' `--check`, the commands the Kubernetes probes run) and runs unprivileged."""
    wait_until(
        "every container healthy",
        lambda: all(deployment.inspect(s, "{{.State.Health.Status}}") == "healthy" for s in SERVICES),
        300,
        deployment,
        interval_s=2.0,
    )
    for service in ("controller", *WORKER_SERVICES):
        assert deployment.exec(service, "id", "-u") == "10001", service
    for service in WORKER_SERVICES:  # the liveness command itself, as the probes run it (exit status 0)
        deployment.exec(service, "python", "-m", f"dejavu_{service.split('-worker')[0]}_worker", "--check")
    assert deployment.exec("redis", "id", "-u") == "999"
    # The controller image carries no torch.
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    assert deployment.exec("controller", "python", "-c", probe) == "True"


def test_workers_load_the_native_kernels_built_for_their_cpu_level(deployment: Deployment) -> None:
    """The images carry no compiler but a build of the native kernels per CPU level: a worker loads the best
    one its CPU runs, so containers serve with the paged KV pool and native attention as `dejavu up` does."""
    from dejavu_engine import native

    cpu = set(native._cpu_flags().split())
    if not any(needs <= cpu for _level, needs in native.PORTABLE):
        pytest.skip("this CPU runs none of the levels the images carry")
    probe = "from dejavu_engine import native; print(getattr(native.load(), '__file__', None))"
    for service in ("prompt-worker-0", "token-worker-0"):
        loaded = deployment.exec(service, "python", "-c", probe).splitlines()[-1]
        assert loaded.startswith("/opt/venv/share/dejavu/kernels/x86-64-v"), f"{service}: {loaded}"


def test_redis_has_its_acl_users_and_persists(deployment: Deployment) -> None:
    anonymous = redis.Redis(port=deployment.redis_port, socket_timeout=10)
    assert anonymous.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        anonymous.get(keys.TOPOLOGY)
    admin = deployment.redis_admin()
    assert admin.get(keys.TOPOLOGY) is not None
    with pytest.raises(redis.exceptions.NoPermissionError):
        admin.set(keys.TOPOLOGY, b"forged")
    # Append-only persistence on the volume mounted at /data.
    assert "appendonly" in deployment.exec("redis", "ls", "/data")


def test_greedy_requests_match_the_engine(deployment: Deployment, reference: dict[str, str]) -> None:
    refused = OpenAI(base_url=deployment.api_url + "/v1", api_key="not-the-key", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.models.list()
    client = OpenAI(base_url=deployment.api_url + "/v1", api_key=deployment.api_key, timeout=180, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    texts = Round(client).finish(deployment=deployment)
    for prompt in PROMPTS:
        assert texts[prompt] == reference[prompt], f"{prompt!r}\n{deployment.logs()}"
    # UCX between containers went over TCP alone (compose.yaml sets UCX_TLS=tcp and requires it).
    selected = re.findall(r"UCX to \S+ uses transports \[([^\]]*)\]", deployment.logs(tail=100000))
    assert selected and set(selected) == {"'tcp'"}, selected


def test_a_killed_token_worker_container_is_replaced_and_streams_stay_exact(
    deployment: Deployment, reference: dict[str, str]
) -> None:
    """SIGKILL the container of token stage 1 while four requests stream: the spare takes the stage over
    (a new topology epoch) and every stream completes exactly as the engine computes it."""
    admin = deployment.redis_admin()
    victim = holder(admin, 1)
    assert victim.startswith("t-") and victim != "t-token-worker-spare"
    epoch = int(admin.get(keys.EPOCH))
    client = OpenAI(base_url=deployment.api_url + "/v1", api_key=deployment.api_key, timeout=300, max_retries=0)
    r = Round(client)
    r.wait_chunks(8)
    before = time.monotonic()  # detection is timed from here: the `docker kill` command itself is slow
    subprocess.run(["docker", "kill", deployment.container(victim[2:])], check=True, capture_output=True, timeout=60)
    killed = time.monotonic()
    deadline = killed + 120
    while int(admin.get(keys.EPOCH)) == epoch and time.monotonic() < deadline:
        time.sleep(0.02)
    repaired = time.monotonic()
    assert int(admin.get(keys.EPOCH)) > epoch, f"no new topology after the kill\n{deployment.logs()}"
    texts = r.finish(deployment=deployment)
    resumed = min((t for t in r.arrivals if t > killed), default=None)
    for prompt in PROMPTS:
        assert texts[prompt] == reference[prompt], f"{prompt!r}\n{deployment.logs()}"
    assert holder(admin, 1) == "t-token-worker-spare"
    after = f"{resumed - before:.2f} s" if resumed is not None else "never (all tokens came before)"
    controller = subprocess.run(
        ["docker", "logs", deployment.container("controller")], capture_output=True, text=True, timeout=30
    )
    phases = re.findall(
        r"lost \[.*?\]: repairing .*|recovery at epoch \d+ done: .*", controller.stdout + controller.stderr
    )
    print(
        f"\nkilled {victim} (`docker kill` took {killed - before:.2f} s): new topology {repaired - before:.2f} s "
        f"after the kill began, first token after it {after}, all streams done {time.monotonic() - before:.1f} s "
        f"after it; controller: {phases}"
    )
