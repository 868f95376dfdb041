"""Local process supervisor behind ``dejavu up``: Redis, the controller and the workers on one host.

Every child gets the launcher's settings as ``DEJAVU_*`` variables, except the admin signing key:
without a configured admin key pair the launcher makes one, hands workers only the verify key and
keeps the signing key in its private run directory (:mod:`.rundir`), where ``dejavu admin`` finds it.
The launcher writes a state file (PIDs) there so ``dejavu down`` can stop a system started elsewhere,
gives a Redis it starts its password in a private config file (never on a command line), restarts a
worker that crashes (as the paper's recovery step 1 allows: "the crashed process restarted by the
launcher"), and stops every child by PID on exit.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import redis
from pydantic import SecretStr

from dejavu_cli.rundir import read_private, run_dir, write_private
from dejavu_common.admin import generate_keypair
from dejavu_common.settings import DEV_DATA_PLANE_SECRET, Mode, Settings
from dejavu_engine.process import worker_environment

log = logging.getLogger("dejavu.launcher")

STATE_NAME = "up.json"
ADMIN_KEY_NAME = "admin.env"  # DEJAVU_ADMIN__SIGNING_KEY=... of the running local deployment
_CHILD_SECRETS = ("DEJAVU_ADMIN__SIGNING_KEY",)  # no child signs admin commands
# A bound, and no eviction within it: a silently evicted lease, stream entry or watermark would break
# recovery, while a refused write is seen and reported by the service that made it (as infra/redis).
_REDIS_MEMORY = ("--maxmemory", "256mb", "--maxmemory-policy", "noeviction")


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool
    proc: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def runs_prompts(self) -> bool:
        """Whether this child is a prompt worker (active or spare)."""
        return "dejavu_prompt_worker" in self.argv


@dataclass
class Launcher:
    settings: Settings
    spares: int = 0  # spare token workers
    prompt_spares: int = 0
    restart_workers: bool = True
    pin_cpus: bool = False  # give each active worker its own core(s), round-robin, like separate machines
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dejavu-logs-")))
    children: list[Child] = field(default_factory=list)
    redis_proc: subprocess.Popen | None = None

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        self._ensure_secrets()
        self._ensure_redis()
        c = self.settings.controller
        n_prompt = 0 if c.mode is Mode.COLOCATED else c.prompt_depth
        py = sys.executable
        self.children.append(Child("controller", [py, "-m", "dejavu_controller"], restart=False))
        for i in range(n_prompt):
            self.children.append(Child(f"p{i}", [py, "-m", "dejavu_prompt_worker", "--worker-id", f"p{i}"], True))
        for i in range(c.token_depth):
            self.children.append(Child(f"t{i}", [py, "-m", "dejavu_token_worker", "--worker-id", f"t{i}"], True))
        for i in range(self.spares):
            argv = [py, "-m", "dejavu_token_worker", "--worker-id", f"spare{i}", "--spare"]
            self.children.append(Child(f"spare{i}", argv, True))
        for i in range(self.prompt_spares):
            argv = [py, "-m", "dejavu_prompt_worker", "--worker-id", f"pspare{i}", "--spare"]
            self.children.append(Child(f"pspare{i}", argv, True))
        for child in self.children:
            self._spawn(child)
        self._write_state()

    def _env(self, child: Child) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAVU_")}
        env.update(self.settings.to_env())
        for name in _CHILD_SECRETS:
            env.pop(name, None)
        env["PYTHONUNBUFFERED"] = "1"
        if child.name != "controller":
            engine = self.settings.engine
            env["DEJAVU_ENGINE__TORCH_THREADS"] = str(self._threads_of(child))
            if self.pin_cpus:
                env["DEJAVU_ENGINE__CPU_AFFINITY"] = json.dumps(self._cores_of(child))
                engine = engine.model_copy(update={"openmp_bind": True})
            env.update(worker_environment(engine, env))
        return env

    def _threads_of(self, child: Child) -> int:
        """torch threads of a worker: the setting where one is given, one per pinned core, else the host's
        cores divided among the stages of the worker's own pipeline.

        The prompt and the token pipeline of one host take turns more than they run together (while
        requests decode, the prompt pipeline idles), so each may use every core; dividing the cores
        among all workers left a lone token stage one core of two (measured: 1 prompt + 1 token worker
        on 2 cores served 16 concurrent requests at 51 tok/s with one thread each, 68 with two).
        Spares count as the stage they stand in for.
        """
        if self.settings.engine.torch_threads:
            return self.settings.engine.torch_threads
        if self.pin_cpus:
            return len(self._cores_of(child))
        c = self.settings.controller
        depth = c.prompt_depth if child.runs_prompts else c.token_depth
        return max(1, len(os.sched_getaffinity(0)) // depth)

    def _cores_of(self, child: Child) -> list[int]:
        """Active workers take cores round-robin; spares (idle until they replace someone) keep them all."""
        cores = sorted(os.sched_getaffinity(0))
        workers = [c for c in self.children if c.name != "controller" and not c.name.startswith(("spare", "pspare"))]
        if child not in workers:
            return cores
        return [cores[workers.index(child) % len(cores)]]

    def _spawn(self, child: Child) -> None:
        out = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - owned by the child
        child.proc = subprocess.Popen(child.argv, env=self._env(child), stdout=out, stderr=subprocess.STDOUT)
        out.close()
        log.info("started %s (pid %d), log %s", child.name, child.proc.pid, self.log_dir / f"{child.name}.log")

    def _ensure_redis(self) -> None:
        url = self.settings.redis.url
        if _redis_answers(url):
            return
        parsed = urlparse(url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise RuntimeError(f"no Redis answers at {url} and it is not local, so it cannot be started here")
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (run `make setup`)")
        argv = [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no", *_REDIS_MEMORY]
        pw = self.settings.redis.password
        if pw is not None:  # in a 0600 file, not on the command line that `ps` shows every user
            config = run_dir() / f"redis-{port}.conf"
            write_private(config, f"requirepass {pw.get_secret_value()}\n")
            argv.insert(1, str(config))  # redis-server takes the config file as its first argument
        self.redis_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _redis_answers(url, self.settings):
            if time.monotonic() > deadline or self.redis_proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        log.info("started redis-server (pid %d) on port %d", self.redis_proc.pid, port)

    def _ensure_secrets(self) -> None:
        """Replace the public development data-plane secret by a fresh one, and without a configured verify
        key make an admin key pair for this deployment (see the module docstring)."""
        transport = self.settings.transport
        if transport.secret.get_secret_value() == DEV_DATA_PLANE_SECRET:
            fresh = transport.model_copy(update={"secret": SecretStr(secrets.token_hex(32))})
            self.settings = self.settings.model_copy(update={"transport": fresh})
        admin = self.settings.admin
        if admin.verify_key is not None:
            return
        signing, verify = generate_keypair()
        write_private(run_dir() / ADMIN_KEY_NAME, f"DEJAVU_ADMIN__SIGNING_KEY={signing}\n")
        update = {"signing_key": SecretStr(signing), "verify_key": verify}
        self.settings = self.settings.model_copy(update={"admin": admin.model_copy(update=update)})

    def _write_state(self) -> None:
        pids = [c.proc.pid for c in self.children if c.proc] + ([self.redis_proc.pid] if self.redis_proc else [])
        write_private(run_dir() / STATE_NAME, json.dumps({"launcher": os.getpid(), "pids": pids}))

    # -- run ---------------------------------------------------------------------------------
    @property
    def api_url(self) -> str:
        c = self.settings.controller
        return f"http://{c.host}:{c.port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/ready`` answers 200; raises ``TimeoutError`` (or if a child died)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            try:
                with urllib.request.urlopen(self.api_url + "/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the system was not ready within {timeout_s:.0f} s; logs in {self.log_dir}")

    def check_children(self) -> None:
        """Restart crashed workers; raise if the controller died."""
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            code = child.proc.returncode
            if not child.restart:
                raise RuntimeError(f"{child.name} exited with code {code}; log: {self.log_dir / child.name}.log")
            log.warning("%s exited with code %d: restarting it", child.name, code)
            child.restarts += 1
            self._spawn(child)
            self._write_state()

    def supervise(self, stop: callable = lambda: False) -> None:
        while not stop():
            if self.restart_workers:
                self.check_children()
            time.sleep(0.5)

    def child(self, name: str) -> Child:
        """The child process called ``name`` (``controller``, ``p0``, ``t1``, ``spare0``...)."""
        return next(c for c in self.children if c.name == name)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop workers and controller first (they deregister through Redis), then our Redis. The whole
        deployment stops, so workers are told to stop at once (a second SIGTERM), not to drain: a drain
        waits for a hand-over that no controller will make, and they would be killed at the grace
        period without deregistering or cleaning up."""
        procs = [c.proc for c in reversed(self.children) if c.proc is not None]
        workers = [c.proc for c in self.children if c.proc is not None and c.name != "controller"]
        terminate_all(procs, stop_now=workers)
        if self.redis_proc is not None:
            terminate_all([self.redis_proc])
        for name in (STATE_NAME, ADMIN_KEY_NAME):
            (run_dir() / name).unlink(missing_ok=True)


SECOND_SIGTERM_S = 0.3  # between a worker's two SIGTERMs: apart, so the two are never merged into one


def terminate_all(
    procs: list[subprocess.Popen], grace_s: float = 10.0, stop_now: Sequence[subprocess.Popen] = ()
) -> None:
    """SIGTERM every process (those in ``stop_now`` a second time shortly after, which stops a worker
    at once instead of draining it), then SIGKILL what is left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    if stop_now:
        time.sleep(SECOND_SIGTERM_S)
        for p in stop_now:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def stop_from_state_file() -> int:
    """``dejavu down``: SIGTERM the launcher recorded in the state file (it stops its children)."""
    state_file = run_dir() / STATE_NAME
    text = read_private(state_file)  # refuses a file another user could have written
    if text is None:
        return 0
    state = json.loads(text)
    stopped = 0
    for pid in [state["launcher"], *state["pids"]]:
        try:
            os.kill(pid, signal.SIGTERM)
            stopped += 1
        except ProcessLookupError:
            pass
    state_file.unlink(missing_ok=True)
    return stopped


def _redis_answers(url: str, settings: Settings | None = None) -> bool:
    kw = {}
    if settings is not None and settings.redis.password is not None:
        kw["password"] = settings.redis.password.get_secret_value()
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, **kw).ping())
    except redis.RedisError:
        return False
