"""`dejavu bench chaos`: sustained mixed traffic while a schedule of faults hits the deployment.

A disaggregated deployment (1 prompt worker, ``--token-depth`` token stages, one token spare, contexts of
``--max-context`` tokens) serves ``--clients`` concurrent clients for ``--minutes``. After ``--warmup-s`` of
traffic alone, every ``--interval`` seconds the next fault of ``--faults`` (cycled) is injected:

- ``kill``       SIGKILL a random token-stage holder (the launcher restarts it; the spare takes over);
- ``pause``      pause a token stage's heartbeats beyond its lease (a hung worker: fenced, replaced);
- ``redis``      SIGKILL Redis and restart it empty on the same port (no persistence, like ``dejavu up``);
- ``oom``        Redis at ``maxmemory`` for ``--oom-s``: its limit set to what it uses now, with the
                 ``noeviction`` policy, so every write that may grow it fails (OOM), then both restored;
- ``controller`` SIGKILL the controller and start a new one (its clients get connection errors);
- ``drain``      SIGTERM a token-stage holder (a rolling update: it hands its stage over and leaves);
- ``partition``  SIGSTOP a token-stage holder, SIGCONT it 3 lease periods later: it is cut off from Redis
                 and from every peer at once, as behind a network partition, then comes back (fenced).
                 It stands in for a cut link: cutting one TCP or UCX link needs root-only tools (iptables,
                 tc), which this bench does not assume;
- ``corrupt``    a corrupted data-plane payload delivered to a token-stage holder: the bench opens a
                 DejaVuLib endpoint of its own with the deployment's data-plane secret and a published key,
                 and sends a prompt-KV message whose payload fails its MAC, and one sealed in another
                 worker's name. The receiver must drop and count both (its log says so) and keep serving;
- ``slowloris``  ``--slowloris`` connections to the gateway that each send half a request header and stall
                 for ``--slowloris-s``, then close: traffic goes on and ``/health`` answers 200 throughout;
- ``poison``     a burst of hostile-but-valid requests next to the traffic (vanishing temperatures and
                 top_p, extreme stop lists, token ids outside the vocabulary, an oversized body, huge
                 max_tokens, a client that disconnects mid-stream): each must be answered (a completion
                 or a clear error) within ``--hang-s``, no worker may die, the service stays ready.

Traffic is a mix: a ``--non-streaming`` share of requests is not streamed, a ``--no-max-tokens`` share
sends no ``max_tokens`` (chat turns, which end at EOS or at the context: a completion's missing
``max_tokens`` is 16), and a ``--disconnect`` share of streams is left after a few chunks (not counted as
an outcome: after the traffic the gateway must hold no request in flight).
Every other traffic request is greedy and checked against the in-process engine's output: it *completed
exactly*, completed with *wrong* tokens (must be 0), *failed* with an error (allowed across a fault), or
*hung* past ``--hang-s`` (must be 0). For each fault the bench reports how long until the controller is
ready again (at a newer epoch, for the faults that change it), and until a request (resumed across the
fault, or new) next completes exactly; the faults with a check of their own (corrupt, slowloris, oom,
poison) record whether it held. The memory (RSS) of every process (the controller, each worker, Redis) is
read when the deployment is ready, after the warm-up and at the end, with each process's growth since
the warm-up (``restarted`` for a process that is another one by then; a spare that took a stage since
holds a model it did not hold before). Writes ``benchmarks/results/chaos.json`` (with the time at which
every traffic request ended, by outcome, and each fault kind's recovery ranges) and beside it
``chaos.png``: the run's timeline of faults and recoveries (:func:`benchmarks.plots.plot_chaos`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*
from benchmarks.plots import kind_ranges_json, plot_chaos, read_faults, recovery_by_kind
from benchmarks.procs import free_port, rss_mb, stop_on_sigterm

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
]


@dataclass
class Outcomes:
    exact: int = 0
    wrong: int = 0
    failed: int = 0
    hung: int = 0
    disconnected: int = 0  # streams the client left on purpose: no outcome, but the server must free them
    errors: Counter = field(default_factory=Counter)
    wrong_examples: list[dict] = field(default_factory=list)
    poison: Counter = field(default_factory=Counter)  # answered_ok / answered_error / hung
    by_mix: Counter = field(default_factory=Counter)  # "<stream|whole> <max_tokens|chat-context> <outcome>"
    ended_at: dict[str, list[float]] = field(default_factory=dict)  # monotonic end times, by outcome
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str | dict | None = None, mix: str | None = None) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            if kind != "disconnected":
                self.ended_at.setdefault(kind, []).append(time.monotonic())
            if mix is not None:
                self.by_mix[f"{mix} {kind}"] += 1
            if kind == "failed" and isinstance(detail, str):
                self.errors[detail] += 1
            if kind == "wrong" and len(self.wrong_examples) < 5:
                self.wrong_examples.append(detail)


@dataclass(frozen=True)
class Ask:
    """One traffic request: its prompt, whether it streams, its ``max_tokens`` (None: up to the context)
    and, for a client that leaves mid-stream, after how many chunks (None: it reads the whole answer)."""

    prompt: str
    stream: bool
    max_tokens: int | None
    leave_after: int | None = None

    @property
    def mix(self) -> str:
        return f"{'stream' if self.stream else 'whole'} {'max_tokens' if self.max_tokens else 'chat-context'}"


class Disconnected(Exception):
    """The client left the stream on purpose."""


def _complete(api: str, model: str, ask: Ask, timeout_s: float) -> str:
    """One greedy completion's text (streamed or not); raises ``Disconnected`` when the client left the
    stream as ``ask`` says, RuntimeError on an HTTP or in-stream error. A request with ``max_tokens`` is a
    completion of the prompt; one without is a chat turn (the prompt as the user's message), since there a
    missing ``max_tokens`` means what the context leaves (a completion's default is 16)."""
    body: dict = {"model": model, "temperature": 0, "stream": ask.stream}
    if ask.max_tokens is None:
        url, body["messages"] = api + "/v1/chat/completions", [{"role": "user", "content": ask.prompt}]
    else:
        url, body["prompt"], body["max_tokens"] = api + "/v1/completions", ask.prompt, ask.max_tokens
    if not ask.stream:
        r = httpx.post(url, json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(_http_error(r))
        choice = r.json()["choices"][0]
        return choice["text"] if ask.max_tokens is not None else choice["message"]["content"] or ""
    parts = []
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(_http_error(r))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"in-stream error: {chunk['error'].get('code') or chunk['error'].get('type')}")
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                parts.append(choice["text"] if ask.max_tokens is not None else choice["delta"].get("content") or "")
                if ask.leave_after is not None and len(parts) >= ask.leave_after:
                    raise Disconnected  # leaving the `with` closes the connection mid-stream
    return "".join(parts)


def _http_error(r: httpx.Response) -> str:
    """An error answer in a few words: its status and the OpenAI error's code (or type), if it has one."""
    try:
        error = r.json()["error"]
        what = error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        what = None
    return f"HTTP {r.status_code}" + (f" {what}" if what else "")


def _ask(rng: random.Random, args) -> Ask:
    """The next traffic request, drawn by the mix's shares."""
    stream = rng.random() >= args.non_streaming
    return Ask(
        prompt=rng.choice(PROMPTS),
        stream=stream,
        max_tokens=None if rng.random() < args.no_max_tokens else args.max_tokens,
        leave_after=rng.randint(1, 3) if stream and rng.random() < args.disconnect else None,
    )


def _client(api_of, model: str, reference: dict, args, stop: threading.Event, out: Outcomes, seed: int):
    rng = random.Random(seed)
    backoff = 0.0  # like a real client: back off exponentially while the service answers with errors
    while not stop.wait(backoff):
        ask = _ask(rng, args)
        started = time.monotonic()
        try:
            text = _complete(api_of(), model, ask, args.hang_s)
        except Disconnected:
            out.add("disconnected", mix=ask.mix)
            continue
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            hung = time.monotonic() - started >= args.hang_s * 0.99
            out.add("hung" if hung else "failed", "timeout", mix=ask.mix)
            continue
        except Exception as exc:  # connection refused (controller restarting), 503, in-stream errors
            out.add("failed", type(exc).__name__ if not isinstance(exc, RuntimeError) else str(exc), mix=ask.mix)
            backoff = min(max(0.25, 2 * backoff), 4.0)
            continue
        backoff = 0.0
        expected = reference[(ask.prompt, ask.max_tokens)]
        if text == expected:
            out.add("exact", mix=ask.mix)
        else:
            detail = {"prompt": ask.prompt, "mix": ask.mix, "got": text, "expected": expected}
            out.add("wrong", detail, mix=ask.mix)


def _memory(launcher) -> dict[str, dict]:
    """RSS of every process of the deployment: the controller, each worker and Redis (with its pid: a
    restarted process is another one)."""
    procs = {c.name: c.proc for c in launcher.children if c.proc}
    if launcher.redis_proc is not None:
        procs["redis"] = launcher.redis_proc
    return {name: {"pid": proc.pid, "rss_mb": rss_mb(proc.pid)} for name, proc in procs.items()}


def _growth(warm: dict[str, dict] | None, end: dict[str, dict]) -> dict[str, float | str]:
    """Each process's RSS growth from the warm-up to the end, in percent; ``restarted`` for a process
    that is another one now (its growth is not comparable), ``gone`` without a reading."""
    out: dict[str, float | str] = {}
    for name, now in end.items():
        then = (warm or {}).get(name)
        if then is None or then["pid"] != now["pid"]:
            out[name] = "restarted"
        elif not then["rss_mb"] or now["rss_mb"] is None:
            out[name] = "gone"
        else:
            out[name] = round(100 * (now["rss_mb"] - then["rss_mb"]) / then["rss_mb"], 1)
    return out


class Chaos:
    """Injects faults into a running :class:`Launcher` deployment and measures each recovery."""

    def __init__(self, launcher, settings, reference: dict[str, str], args, outcomes: Outcomes) -> None:
        self.launcher, self.settings, self.reference, self.args = launcher, settings, reference, args
        self.outcomes = outcomes
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()  # the launcher's children list is shared with the supervisor
        self.check: dict | None = None  # what the last fault's own check found (corrupt, slowloris, oom)
        self._injector = None  # the bench's own data-plane endpoint (corrupt), made at the first use
        self._seq = 0

    def holder(self, stage: int) -> str:
        import redis

        from dejavu_common import keys
        from dejavu_common.messages import Topology

        client = redis.Redis.from_url(self.settings.redis.url, socket_timeout=2)
        raw = client.get(keys.TOPOLOGY)
        if raw is None:
            raise RuntimeError("no topology published")
        return Topology.decode(raw).token_stages[stage].worker_id

    def inject(self, kind: str) -> str:
        self.check = None
        stage = self.rng.randrange(self.settings.controller.token_depth)
        if kind == "oom":
            return self.oom()
        if kind == "slowloris":
            return self.slowloris()
        if kind == "corrupt":
            return self.corrupt(stage)
        if kind == "kill":
            victim = self.holder(stage)
            os.kill(self.launcher.child(victim).proc.pid, signal.SIGKILL)
            return f"SIGKILL {victim} (token stage {stage})"
        if kind == "drain":
            victim = self.holder(stage)
            self.launcher.child(victim).proc.send_signal(signal.SIGTERM)
            return f"SIGTERM {victim} (token stage {stage})"
        if kind == "pause":
            import redis

            from dejavu_common import keys
            from dejavu_common.admin import sign
            from dejavu_common.messages import AdminAction, WorkerInfo

            victim = self.holder(stage)
            admin = self.launcher.settings.admin  # the key pair `dejavu up` made for this deployment
            if admin.signing_key is None:
                raise RuntimeError("the deployment has no admin signing key")
            client = redis.Redis.from_url(self.settings.redis.url, socket_timeout=2)
            info = WorkerInfo.decode(client.hget(keys.worker(victim), "info"))
            seconds = self.settings.recovery.lease_ttl_s * 3
            cmd = sign(
                admin.signing_key.get_secret_value(),
                victim,
                info.instance,
                AdminAction.PAUSE_HEARTBEATS,
                seconds=seconds,
                ttl_s=admin.command_ttl_s,
            )
            client.xadd(keys.ADMIN_STREAM, {"cmd": cmd.encode()})
            return f"pause heartbeats of {victim} for {seconds:.1f} s"
        if kind == "redis":
            with self.lock:
                proc = self.launcher.redis_proc
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                self.launcher._ensure_redis()  # an empty one on the same port
            return "SIGKILL Redis, restart empty"
        if kind == "partition":
            victim = self.holder(stage)
            pid = self.launcher.child(victim).proc.pid
            seconds = self.settings.recovery.lease_ttl_s * 3
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, _signal_quietly, (pid, signal.SIGCONT)).start()
            return f"SIGSTOP {victim} (token stage {stage}) for {seconds:.1f} s"
        if kind == "poison":
            answers = _poison(self.launcher.api_url, self.settings.model.name, self.args.hang_s)
            for outcome in answers.values():
                self.outcomes.poison[outcome] += 1
            return f"poison requests answered: {answers}"
        if kind == "controller":
            with self.lock:
                controller = self.launcher.child("controller")
                controller.proc.kill()
                controller.proc.wait(10)
                self.launcher._spawn(controller)
            return "SIGKILL the controller, start a new one"
        raise ValueError(f"unknown fault {kind!r}")

    def oom(self) -> str:
        """Redis at ``maxmemory`` (what it uses now, ``noeviction``) for ``--oom-s``, then as it was."""
        import redis

        client = redis.Redis.from_url(self.settings.redis.url, socket_timeout=2)
        saved = client.config_get("maxmemory") | client.config_get("maxmemory-policy")
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", used)
        refused = 0
        try:
            deadline = time.monotonic() + self.args.oom_s
            while time.monotonic() < deadline:  # proof that writes fail now (a key of the bench's own)
                try:
                    client.set("dejavu:chaos:oom-probe", "x" * 4096)
                except redis.exceptions.OutOfMemoryError:
                    refused += 1
                time.sleep(0.5)
        finally:
            client.config_set("maxmemory", saved["maxmemory"])
            client.config_set("maxmemory-policy", saved["maxmemory-policy"])
            client.delete("dejavu:chaos:oom-probe")
        self.check = {"ok": refused > 0, "probe_writes_refused": refused}
        return f"Redis at maxmemory ({used / 1e6:.1f} MB, noeviction) for {self.args.oom_s:g} s"

    def slowloris(self) -> str:
        """``--slowloris`` connections that send half a request header and stall for ``--slowloris-s``,
        then close; /health is polled on the API port meanwhile and must answer 200 each time."""
        import socket

        port = self.settings.controller.port
        half = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: "
        sockets: list[socket.socket] = []
        refused = 0
        health: Counter = Counter()
        try:
            for _ in range(self.args.slowloris):
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                    sockets.append(sock)
                    sock.sendall(half)
                except OSError:  # refused, or already closed by the gateway: it handled the connection
                    refused += 1
            deadline = time.monotonic() + self.args.slowloris_s
            while time.monotonic() < deadline:
                try:
                    status = httpx.get(self.launcher.api_url + "/health", timeout=5).status_code
                    health[str(status)] += 1
                except httpx.HTTPError as exc:
                    health[type(exc).__name__] += 1
                time.sleep(0.5)
        finally:
            closed_by_server = sum(_closed(sock) for sock in sockets)
            for sock in sockets:
                sock.close()
        self.check = {
            "ok": set(health) == {"200"},
            "health": dict(health),
            "connections": self.args.slowloris,
            "not_opened": refused,
            "closed_by_the_gateway": closed_by_server,
        }
        return (
            f"slowloris: {self.args.slowloris} half headers stalled {self.args.slowloris_s:g} s "
            f"({closed_by_server} closed by the gateway); /health: {dict(health)}"
        )

    def corrupt(self, stage: int) -> str:
        """Two forged prompt-KV messages to a token-stage holder from the bench's own data-plane endpoint
        (the deployment's secret, a published key of its own): one whose payload fails its MAC, one
        sealed in another worker's name. The receiver must log both as dropped and keep running."""
        import base64

        import numpy as np
        import redis

        from dejavu_common import keys
        from dejavu_common.messages import WorkerInfo, WorkerRole
        from dejavulib.header import Channel, Header, secret_key, sender_field

        victim = self.holder(stage)
        depth = self.settings.controller.token_depth
        other = self.holder((stage + 1) % depth) if depth > 1 else "p0"  # whose name the second one takes
        transport = self.launcher.settings.transport  # with the deployment's fresh data-plane secret
        client = redis.Redis.from_url(self.settings.redis.url, socket_timeout=2)
        if self._injector is None:
            self._injector = _injector(transport, client)
        ep = self._injector
        info = WorkerInfo(
            worker_id=INJECTOR,
            role=WorkerRole.TOKEN,
            host="chaos",
            pid=os.getpid(),
            instance="chaos",
            data_address=base64.b64encode(ep.address).decode(),
            data_key=ep.data_key,
        )
        # Its record only (not in the set of workers the controller assigns stages to): the receiver
        # looks the sender's key up there. Redis may have restarted empty since the last time.
        client.hset(keys.worker(INJECTOR), mapping={"info": info.encode()})
        log = self.launcher.log_dir / f"{victim}.log"
        before = _count_in(log, victim)
        epoch = self.epoch() or 0
        ep.set_epoch(epoch)
        ep.connect_all(client, [victim])
        member = secret_key(transport.secret.get_secret_value())
        key, key_id = ep.keys.sending(victim)
        data = np.frombuffer(os.urandom(4096), np.uint8)
        for sender, flip in ((sender_field(INJECTOR), True), (sender_field(other), False)):
            self._seq += 1
            header = Header(Channel.KV_PROMPT, microbatch=1 << 30, user=stage).with_payload(
                memoryview(data), key, epoch=epoch, seq=self._seq, sender=sender, key_id=key_id
            )
            payload = data.copy()
            if flip:
                payload[len(payload) // 2] ^= 0x40  # after sealing, as a bad link would
            ep._ep.transport.send_message(victim, header.pack(member, key), payload).wait(10)
        deadline = time.monotonic() + 10
        after = _count_in(log, victim)
        while time.monotonic() < deadline and not (after[0] > before[0] and after[1] > before[1]):
            time.sleep(0.2)
            after = _count_in(log, victim)
        proc = self.launcher.child(victim).proc
        alive = proc is not None and proc.poll() is None
        dropped_corrupt, dropped_sender = after[0] - before[0], after[1] - before[1]
        self.check = {
            "ok": dropped_corrupt >= 1 and dropped_sender >= 1 and alive,
            "victim": victim,
            "dropped_corrupt_payload": dropped_corrupt,
            "dropped_in_another_workers_name": dropped_sender,
            "victim_alive": alive,
        }
        return (
            f"corrupt payload and a message in {other}'s name to {victim} (token stage {stage}): "
            f"dropped {dropped_corrupt} + {dropped_sender}, alive: {alive}"
        )

    def close(self) -> None:
        if self._injector is not None:
            self._injector.close()

    def epoch(self) -> int | None:
        import redis

        from dejavu_common import keys

        try:
            raw = redis.Redis.from_url(self.settings.redis.url, socket_timeout=1).get(keys.EPOCH)
        except redis.RedisError:
            return None
        return None if raw is None else int(raw)

    def back_s(self, since: float, epoch: int, new_epoch: bool = True, until: float | None = None) -> float | None:
        """Seconds from ``since`` until the controller is ready at an epoch newer than ``epoch`` (every
        fault that fails a worker or Redis makes it publish one; after the others: ready, at any epoch): the
        service is back. None when not by ``until`` (default: an interval after ``since``)."""
        deadline = since + self.args.interval if until is None else until
        while time.monotonic() < deadline:
            now = self.epoch()
            if now is not None and (now > epoch or not new_epoch):
                try:
                    if httpx.get(self.launcher.api_url + "/ready", timeout=1).status_code == 200:
                        return time.monotonic() - since
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        return None

    def recovery_s(self, since: float, outcomes: Outcomes, until: float | None = None) -> float | None:
        """Seconds from ``since`` until a request (resumed or new) next completes exactly; None when none
        does by ``until`` (default: an interval after ``since``). It includes the rest of that request's
        generation."""
        deadline = since + self.args.interval if until is None else until
        while time.monotonic() < deadline:
            with outcomes.lock:
                after = [t for t in outcomes.ended_at.get("exact", [])[-64:] if t > since]
            if after:
                return min(after) - since
            time.sleep(0.05)
        return None


INJECTOR = "chaos-injector"  # the worker id of the bench's own data-plane endpoint


def _injector(transport, registry):
    """The bench's own data-plane endpoint (as a worker's, over UCX with the deployment's settings), whose
    failures are logged: unlike a worker, the bench must not end at once, or its deployment outlives it."""
    from dejavu_worker.endpoint import DataEndpoint
    from dejavulib.transport.ucx import UcxTransport

    ucx = UcxTransport(
        INJECTOR,
        progress=transport.ucx_progress,
        require=transport.ucx_require,
        host=transport.host,
        tls=transport.ucx_tls,
        chunks=False,
    )
    endpoint = DataEndpoint(transport, INJECTOR, transport=ucx, registry=registry)
    endpoint.streamer.on_failure = lambda exc: print(f"the injector's streamer failed: {exc!r}", file=sys.stderr)
    return endpoint


def _count_in(log: Path, worker_id: str) -> tuple[int, int]:
    """How many corrupt payloads, and messages from a sender it could not authenticate, the log of
    ``worker_id`` says it dropped."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0, 0
    return text.count(f"dropped a corrupt KV_PROMPT message on {worker_id} ("), text.count(
        f"dropped a message on {worker_id}:"
    )


def _closed(sock) -> bool:
    """Whether the gateway closed ``sock`` already (EOF or reset)."""
    sock.settimeout(0.001)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _signal_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # restarted meanwhile
        os.kill(pid, sig)


def _poison(api: str, model: str, hang_s: float) -> dict[str, str]:
    """Send the hostile-but-valid requests at once; each one's outcome: ``answered_ok`` (a completion),
    ``answered_error`` (an HTTP error status or an in-stream error: a clear refusal) or ``hung``."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    bodies = {
        "temperature 1e-300": ("chat", {**chat, "temperature": 1e-300}),
        "temperature 5e-324, top_p 1e-300": ("chat", {**chat, "temperature": 5e-324, "top_p": 1e-300}),
        "temperature 2, top_k 1": ("chat", {**chat, "temperature": 2.0, "top_k": 1}),
        "extreme stop list": ("chat", {**chat, "stop": ["\u0000" * 1000, "a" * 5000, "", "é" * 64]}),
        "token ids outside the vocabulary": ("completions", {"model": model, "prompt": [2**31 - 1, -5]}),
        "max_tokens 10^9": ("completions", {"model": model, "prompt": "Hi", "max_tokens": 10**9}),
        "body of 8 MB": ("completions", {"model": model, "prompt": "x " * (4 << 20)}),
        "seed 2^64-1": ("chat", {**chat, "temperature": 1.0, "seed": 2**64 - 1}),
    }
    answers: dict[str, str] = {}

    def send(name: str, endpoint: str, body: dict) -> None:
        try:
            r = httpx.post(
                f"{api}/v1/{'chat/completions' if endpoint == 'chat' else endpoint}", json=body, timeout=hang_s
            )
            answers[name] = "answered_ok" if r.status_code == 200 else "answered_error"
        except httpx.TimeoutException:
            answers[name] = "hung"
        except httpx.HTTPError:
            answers[name] = "answered_error"  # e.g. the server closed an oversized upload

    def disconnect() -> None:
        body = {**chat, "max_tokens": 64, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{api}/v1/chat/completions", json=body, timeout=hang_s) as r:
                for i, _line in enumerate(r.iter_lines()):
                    if i >= 2:
                        break  # leave mid-stream
            answers["client disconnects mid-stream"] = "answered_ok"
        except httpx.TimeoutException:
            answers["client disconnects mid-stream"] = "hung"
        except httpx.HTTPError:
            answers["client disconnects mid-stream"] = "answered_error"

    threads = [threading.Thread(target=send, args=(name, *rest), daemon=True) for name, rest in bodies.items()]
    threads.append(threading.Thread(target=disconnect, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(hang_s + 5)
    return answers


def _supervise(chaos: Chaos, stop: threading.Event) -> None:
    """Restart workers that exited (killed or drained), like `dejavu up` does."""
    while not stop.wait(0.5):
        with chaos.lock:
            for child in chaos.launcher.children:
                if child.restart and child.proc is not None and child.proc.poll() is not None:
                    child.restarts += 1
                    chaos.launcher._spawn(child)


def _reference(model: Path, max_tokens: int, max_context: int) -> dict[tuple[str, int | None], str]:
    """The in-process engine's greedy text of each prompt, by (prompt, max_tokens): a completion of
    ``max_tokens``, and (None) a chat turn of what the context leaves, as the gateway fills in a chat's
    missing ``max_tokens``."""
    from dejavu_common.messages import SamplingSpec
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.generate import Request, generate_batch
    from dejavu_engine.pipeline import Pipeline

    tokenizer = Tokenizer.from_pretrained(model)
    pipeline = Pipeline(model, 1)
    eos = pipeline.spec.eos_token_ids | tokenizer.eos_token_ids
    context = min(pipeline.spec.max_positions, max_context)
    out = {}
    for prompt in PROMPTS:
        for budget in (max_tokens, None):
            chat = [{"role": "user", "content": prompt}]
            ids = tuple(tokenizer.encode(prompt) if budget else tokenizer.apply_chat_template(chat))
            sampling = SamplingSpec(max_tokens=context - len(ids) if budget is None else budget, temperature=0)
            (completion,), _ = generate_batch(pipeline, [Request(ids, sampling, eos)])
            out[prompt, budget] = tokenizer.decode(completion.token_ids)
    return out


def _in_flight(api: str) -> float | None:
    """Requests the gateway holds now (``dejavu_key_in_flight``, summed over keys); None: no answer."""
    try:
        text = httpx.get(api + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("dejavu_key_in_flight{"))


def _drained(api: str, timeout_s: float) -> float | None:
    """Wait up to ``timeout_s`` for the gateway to hold no request (the clients have stopped, those that
    left mid-stream included); what it still holds then."""
    deadline = time.monotonic() + timeout_s
    held = _in_flight(api)
    while held != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        held = _in_flight(api)
    return held


FAULTS = "kill,oom,pause,slowloris,redis,corrupt,poison,controller,partition,drain"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dejavu bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long traffic runs (the warm-up included)")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between faults")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="traffic alone before the first fault")
    parser.add_argument("--faults", default=FAULTS, help="cycled in this order")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=16, help="the max_tokens of the requests that set it")
    parser.add_argument("--max-context", type=int, default=256, help="the deployment's engine.max_context")
    parser.add_argument("--non-streaming", type=float, default=0.25, help="share of requests not streamed")
    parser.add_argument("--no-max-tokens", type=float, default=0.15, help="share of requests without max_tokens")
    parser.add_argument("--disconnect", type=float, default=0.1, help="share of streams left after 1-3 chunks")
    parser.add_argument("--token-depth", type=int, default=2)
    parser.add_argument("--oom-s", type=float, default=3.0, help="how long Redis stays at maxmemory (oom)")
    parser.add_argument("--slowloris", type=int, default=1000, help="stalled connections of a slowloris burst")
    parser.add_argument("--slowloris-s", type=float, default=5.0, help="how long they stall")
    parser.add_argument("--hang-s", type=float, default=120.0, help="a request running longer than this hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    return parser


def _settings(base, model: Path, args):
    return base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"}),
            "model": base.model.model_copy(update={"path": model}),
            "engine": base.engine.model_copy(update={"torch_threads": 1, "max_context": args.max_context}),
            "controller": base.controller.model_copy(
                update={
                    "port": free_port(),
                    "token_depth": args.token_depth,
                    "prompt_microbatch": 2,
                    "token_microbatch": 2,
                    "batch_wait_ms": 30.0,
                }
            ),
        }
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS.split(","))
    if unknown:
        raise SystemExit(f"unknown faults {sorted(unknown)} (known: {FAULTS})")
    stop_on_sigterm()  # stopped, it still stops the deployment it started

    from dejavu_cli.launcher import Launcher
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import ensure_default_model

    base = Settings()
    model = ensure_default_model(base)
    print("computing reference outputs ...", file=sys.stderr, flush=True)
    reference = _reference(model, args.max_tokens, args.max_context)
    settings = _settings(base, model, args)
    launcher = Launcher(settings, spares=1, restart_workers=True)
    outcomes = Outcomes()
    faults: list[dict] = []
    stop = threading.Event()
    chaos: Chaos | None = None
    try:
        launcher.start()
        launcher.wait_ready(300)
        chaos = Chaos(launcher, settings, reference, args, outcomes)
        memory_start = _memory(launcher)
        supervisor = threading.Thread(target=_supervise, args=(chaos, stop), daemon=True)
        supervisor.start()
        clients = [
            threading.Thread(
                target=_client,
                args=(lambda: launcher.api_url, settings.model.name, reference, args, stop, outcomes, args.seed + i),
                daemon=True,
            )
            for i in range(args.clients)
        ]
        for t in clients:
            t.start()
        kinds = args.faults.split(",")
        started = time.monotonic()
        end = started + args.minutes * 60
        time.sleep(min(args.warmup_s, args.minutes * 60))
        memory_warm = _memory(launcher)  # traffic has run, no fault yet: the working set to compare the end with
        i = 0
        while time.monotonic() + args.interval <= end:
            time.sleep(args.interval / 2)  # traffic settles first
            kind = kinds[i % len(kinds)]
            i += 1
            epoch = chaos.epoch() or 0
            rss_before = {name: m["rss_mb"] for name, m in _memory(launcher).items()}
            at = time.monotonic()
            try:
                what = chaos.inject(kind)
            except Exception as exc:  # e.g. no topology right now: recorded, the schedule goes on
                faults.append({"kind": kind, "at_s": round(at - started, 2), "injected": False, "error": repr(exc)})
                print(f"{at - started:7.1f} s  {kind}: NOT injected ({exc!r})", file=sys.stderr, flush=True)
                continue
            # After these the service stays up at the same epoch (unless a worker failed meanwhile).
            # A fault that lasts (oom, slowloris, poison) gets its interval from its end to recover in, and
            # the service is ready again when it answers /ready after that end.
            over = time.monotonic()
            until = over + args.interval
            back = chaos.back_s(over if kind in LASTING else at, epoch, new_epoch=kind not in SAME_EPOCH, until=until)
            recovery = chaos.recovery_s(at, outcomes, until=until)
            faults.append(
                {
                    "kind": kind,
                    "what": what,
                    "at_s": round(at - started, 2),
                    "lasted_s": round(over - at, 2),
                    "injected": True,
                    "ready_again_s": None if back is None else round(back, 2),
                    "recovery_s": None if recovery is None else round(recovery, 2),
                    "epoch_changed": (chaos.epoch() or 0) > epoch,  # after poison: a worker failed
                    "rss_mb_before": rss_before,
                    **({"check": chaos.check} if chaos.check is not None else {}),
                }
            )
            failed_check = "" if chaos.check is None or chaos.check["ok"] else f"  CHECK FAILED: {chaos.check}"
            print(
                f"{at - started:7.1f} s  {what}: ready again after {back} s, "
                f"next exact completion after {recovery} s{failed_check}",
                file=sys.stderr,
                flush=True,
            )
            rest = args.interval - (time.monotonic() - at) - args.interval / 2
            if rest > 0:
                time.sleep(rest)
        stop.set()
        for t in clients:
            t.join(args.hang_s + 30)
        hung_threads = sum(t.is_alive() for t in clients)
        held_after = _drained(launcher.api_url, args.hang_s)
        memory_end = _memory(launcher)
        restarts = {c.name: c.restarts for c in launcher.children}
    finally:
        stop.set()
        if chaos is not None:
            chaos.close()
        launcher.stop()
    result = _result(args, outcomes, faults, hung_threads, held_after, restarts, started)
    result["rss_mb"] = {
        "start": memory_start,
        "warm": memory_warm,
        "end": memory_end,
        "growth_pct_since_warm": _growth(memory_warm, memory_end),
    }
    result["recovery_by_kind"] = kind_ranges_json(recovery_by_kind(read_faults(result, str(args.out))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    title = f"dejavu bench chaos: {args.minutes:g} min, a fault every {args.interval:g} s, {args.clients} clients"
    plot_chaos(result, png, title, str(args.out))
    _print(result, args, faults, outcomes)
    print(f"wrote {args.out}\nwrote {png}")
    r = result["requests"]
    poison_ok = outcomes.poison.get("hung", 0) == 0 and result["poison_faults_that_changed_the_topology"] == 0
    checks_ok = result["fault_checks_failed"] == 0 and held_after == 0
    return 0 if r["completed_wrong"] == 0 and r["hung"] == 0 and poison_ok and checks_ok else 1


SAME_EPOCH = {"poison", "oom", "slowloris", "corrupt"}  # the service stays up at its epoch through these
LASTING = {"poison", "oom", "slowloris"}  # ready again counts from their end


def _result(
    args, outcomes: Outcomes, faults: list[dict], hung_threads: int, held_after, restarts, started: float
) -> dict:
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": {
            "completed_exact": outcomes.exact,
            "completed_wrong": outcomes.wrong,
            "failed_with_error": outcomes.failed,
            "hung": outcomes.hung + hung_threads,
            "disconnected_by_the_client": outcomes.disconnected,
        },
        "requests_by_mix": dict(sorted(outcomes.by_mix.items())),
        "in_flight_after_traffic": held_after,  # must be 0: every request, those left mid-stream too, freed
        "poison_requests": dict(outcomes.poison),
        "poison_faults_that_changed_the_topology": sum(
            1 for f in faults if f["kind"] == "poison" and f["injected"] and f["epoch_changed"]
        ),
        "errors": dict(outcomes.errors),
        "wrong_examples": outcomes.wrong_examples,
        "faults": faults,
        "faults_injected": sum(f["injected"] for f in faults),
        "faults_injected_by_kind": dict(Counter(f["kind"] for f in faults if f["injected"])),
        "faults_not_recovered": sum(1 for f in faults if f["injected"] and f.get("recovery_s") is None),
        "fault_checks_failed": sum(1 for f in faults if "check" in f and not f["check"]["ok"]),
        "recovery_s": {
            "max": max(recoveries, default=None),
            "mean": round(sum(recoveries) / len(recoveries), 2) if recoveries else None,
        },
        "faults_not_ready_again": sum(1 for f in faults if f["injected"] and f.get("ready_again_s") is None),
        "process_restarts": restarts,
        # Seconds since traffic started at which each traffic request ended, by outcome (the plot's timeline).
        "outcomes_at_s": {kind: [round(t - started, 2) for t in times] for kind, times in outcomes.ended_at.items()},
    }


def _print(result: dict, args, faults: list[dict], outcomes: Outcomes) -> None:
    r = result["requests"]
    print(
        f"\nchaos: {result['faults_injected']} faults injected ({len(faults) - result['faults_injected']} not) "
        f"in {args.minutes:g} min, {args.clients} clients; "
        f"requests: {r['completed_exact']} exact, {r['completed_wrong']} wrong, "
        f"{r['failed_with_error']} failed with an error, {r['hung']} hung "
        f"({r['disconnected_by_the_client']} streams left by their client; "
        f"in flight after the traffic: {result['in_flight_after_traffic']})"
    )
    print(f"  by mix: {result['requests_by_mix']}")
    print(
        f"  poison requests: {dict(outcomes.poison)}; poison faults after which the topology changed: "
        f"{result['poison_faults_that_changed_the_topology']}; fault checks failed: {result['fault_checks_failed']}"
    )
    print(f"  {'fault':11s} {'ready again s':28s} next exact completion s")
    for kind in dict.fromkeys(f["kind"] for f in faults):
        mine = [f for f in faults if f["kind"] == kind and f["injected"]]
        ready = ", ".join("-" if f["ready_again_s"] is None else f"{f['ready_again_s']:.1f}" for f in mine)
        exact = ", ".join("-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}" for f in mine)
        print(f"  {kind:11s} {ready:28s} {exact}")
    rss = result["rss_mb"]
    print(f"  {'process':10s} {'start MB':>9s} {'warm MB':>9s} {'end MB':>9s}  growth since warm-up")
    for name, end in rss["end"].items():
        start, warm = rss["start"].get(name, {}), (rss["warm"] or {}).get(name, {})
        growth = rss["growth_pct_since_warm"][name]
        print(
            f"  {name:10s} {start.get('rss_mb')!s:>9s} {warm.get('rss_mb')!s:>9s} {end['rss_mb']!s:>9s}  "
            f"{growth if isinstance(growth, str) else f'{growth:+.1f} %'}"
        )


if __name__ == "__main__":
    sys.exit(main())
