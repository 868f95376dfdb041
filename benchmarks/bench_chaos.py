"""`dejavu bench chaos`: sustained concurrent traffic while a schedule of faults hits the deployment.

A disaggregated deployment (1 prompt worker, ``--token-depth`` token stages, one token spare) serves
``--clients`` concurrent streaming clients for ``--minutes``; every ``--interval`` seconds the next fault
of ``--faults`` (cycled) is injected:

- ``kill``       SIGKILL a random token-stage holder (the launcher restarts it; the spare takes over);
- ``pause``      pause a token stage's heartbeats beyond its lease (a hung worker: fenced, replaced);
- ``redis``      SIGKILL Redis and restart it empty on the same port (no persistence, like ``dejavu up``);
- ``controller`` SIGKILL the controller and start a new one (its clients get connection errors);
- ``drain``      SIGTERM a token-stage holder (a rolling update: it hands its stage over and leaves);
- ``partition``  SIGSTOP a token-stage holder, SIGCONT it 3 lease periods later: it is cut off from Redis
                 and from every peer at once, as behind a network partition, then comes back (fenced);
- ``poison``     a burst of hostile-but-valid requests next to the traffic (vanishing temperatures and
                 top_p, extreme stop lists, token ids outside the vocabulary, an oversized body, huge
                 max_tokens, a client that disconnects mid-stream): each must be answered (a completion
                 or a clear error) within ``--hang-s``, no worker may die, the service stays ready.

Every traffic request is greedy and checked against the in-process engine's output: it *completed exactly*,
completed with *wrong* tokens (must be 0), *failed* with an error (allowed across a fault), or *hung*
past ``--hang-s`` (must be 0). For each fault the bench reports how long until the controller is ready
again at a newer epoch, and until a request (resumed across the fault, or new) next completes
exactly. Worker memory (RSS) is read at the start and the end. Writes ``benchmarks/results/chaos.json``
(with the time at which every traffic request ended, by outcome, and each fault kind's recovery ranges)
and beside it ``chaos.png``: the run's timeline of faults and recoveries (:func:`benchmarks.plots.plot_chaos`).
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
    errors: Counter = field(default_factory=Counter)
    wrong_examples: list[dict] = field(default_factory=list)
    poison: Counter = field(default_factory=Counter)  # answered_ok / answered_error / hung
    ended_at: dict[str, list[float]] = field(default_factory=dict)  # monotonic end times, by outcome
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str | dict | None = None) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            self.ended_at.setdefault(kind, []).append(time.monotonic())
            if kind == "failed" and isinstance(detail, str):
                self.errors[detail] += 1
            if kind == "wrong" and len(self.wrong_examples) < 5:
                self.wrong_examples.append(detail)


def _complete(api: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> str:
    """Stream one greedy completion; its text. Raises on an HTTP or in-stream error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"in-stream error: {chunk['error'].get('code') or chunk['error'].get('type')}")
            if chunk.get("choices"):
                parts.append(chunk["choices"][0]["text"])
    return "".join(parts)


def _client(api_of, model: str, reference: dict[str, str], args, stop: threading.Event, out: Outcomes, seed: int):
    rng = random.Random(seed)
    backoff = 0.0  # like a real client: back off exponentially while the service answers with errors
    while not stop.wait(backoff):
        prompt = rng.choice(PROMPTS)
        started = time.monotonic()
        try:
            text = _complete(api_of(), model, prompt, args.max_tokens, args.hang_s)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            out.add("hung" if time.monotonic() - started >= args.hang_s * 0.99 else "failed", "timeout")
            continue
        except Exception as exc:  # connection refused (controller restarting), 503, in-stream errors
            out.add("failed", type(exc).__name__ if not isinstance(exc, RuntimeError) else str(exc))
            backoff = min(max(0.25, 2 * backoff), 4.0)
            continue
        backoff = 0.0
        if text == reference[prompt]:
            out.add("exact")
        else:
            out.add("wrong", {"prompt": prompt, "got": text, "expected": reference[prompt]})


def _worker_memory(launcher) -> dict[str, dict]:
    """RSS of each worker process (its pid too: a restarted worker is another process)."""
    return {
        c.name: {"pid": c.proc.pid, "rss_mb": rss_mb(c.proc.pid)}
        for c in launcher.children
        if c.name != "controller" and c.proc
    }


class Chaos:
    """Injects faults into a running :class:`Launcher` deployment and measures each recovery."""

    def __init__(self, launcher, settings, reference: dict[str, str], args, outcomes: Outcomes) -> None:
        self.launcher, self.settings, self.reference, self.args = launcher, settings, reference, args
        self.outcomes = outcomes
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()  # the launcher's children list is shared with the supervisor

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
        stage = self.rng.randrange(self.settings.controller.token_depth)
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

    def epoch(self) -> int | None:
        import redis

        from dejavu_common import keys

        try:
            raw = redis.Redis.from_url(self.settings.redis.url, socket_timeout=1).get(keys.EPOCH)
        except redis.RedisError:
            return None
        return None if raw is None else int(raw)

    def back_s(self, since: float, epoch: int, new_epoch: bool = True) -> float | None:
        """Seconds from ``since`` until the controller is ready at an epoch newer than ``epoch`` (every
        fault but poison makes it publish one; after poison: ready, at any epoch): the service is back.
        None when not within the interval."""
        deadline = since + self.args.interval
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

    def recovery_s(self, since: float, outcomes: Outcomes) -> float | None:
        """Seconds from ``since`` until a request (resumed or new) next completes exactly; None when
        none does within the interval. It includes the rest of that request's generation."""
        deadline = since + self.args.interval
        while time.monotonic() < deadline:
            with outcomes.lock:
                after = [t for t in outcomes.ended_at.get("exact", [])[-64:] if t > since]
            if after:
                return min(after) - since
            time.sleep(0.05)
        return None


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


def _reference(model: Path, max_tokens: int) -> dict[str, str]:
    from dejavu_common.messages import SamplingSpec
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.generate import Request, generate_batch
    from dejavu_engine.pipeline import Pipeline

    tokenizer = Tokenizer.from_pretrained(model)
    pipeline = Pipeline(model, 1)
    eos = pipeline.spec.eos_token_ids | tokenizer.eos_token_ids
    out = {}
    for prompt in PROMPTS:
        request = Request(tuple(tokenizer.encode(prompt)), SamplingSpec(max_tokens=max_tokens, temperature=0), eos)
        (completion,), _ = generate_batch(pipeline, [request])
        out[prompt] = tokenizer.decode(completion.token_ids)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long traffic runs")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between faults")
    parser.add_argument(
        "--faults", default="kill,pause,redis,poison,controller,partition,drain", help="cycled in this order"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--token-depth", type=int, default=2)
    parser.add_argument("--hang-s", type=float, default=120.0, help="a request running longer than this hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = parser.parse_args(argv)
    stop_on_sigterm()  # stopped, it still stops the deployment it started

    from dejavu_cli.launcher import Launcher
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import ensure_default_model

    base = Settings()
    model = ensure_default_model(base)
    print("computing reference outputs ...", file=sys.stderr, flush=True)
    reference = _reference(model, args.max_tokens)
    settings = base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"}),
            "model": base.model.model_copy(update={"path": model}),
            "engine": base.engine.model_copy(update={"torch_threads": 1}),
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
    launcher = Launcher(settings, spares=1, restart_workers=True)
    outcomes = Outcomes()
    faults: list[dict] = []
    stop = threading.Event()
    try:
        launcher.start()
        launcher.wait_ready(300)
        chaos = Chaos(launcher, settings, reference, args, outcomes)
        memory_start = _worker_memory(launcher)
        memory_warm: dict[str, dict] | None = None
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
        i = 0
        while time.monotonic() + args.interval <= end:
            time.sleep(min(args.interval / 2, max(0.0, end - time.monotonic())))  # traffic settles first
            kind = kinds[i % len(kinds)]
            i += 1
            epoch = chaos.epoch() or 0
            memory_now = _worker_memory(launcher)
            if memory_warm is None:  # traffic has settled, no fault yet: the working set to compare the end with
                memory_warm = memory_now
            rss_before = {name: m["rss_mb"] for name, m in memory_now.items()}
            at = time.monotonic()
            try:
                what = chaos.inject(kind)
            except Exception as exc:  # e.g. no topology right now: recorded, the schedule goes on
                faults.append({"kind": kind, "at_s": round(at - started, 2), "injected": False, "error": repr(exc)})
                print(f"{at - started:7.1f} s  {kind}: NOT injected ({exc!r})", file=sys.stderr, flush=True)
                continue
            back = chaos.back_s(at, epoch, new_epoch=kind != "poison")
            recovery = chaos.recovery_s(at, outcomes)
            faults.append(
                {
                    "kind": kind,
                    "what": what,
                    "at_s": round(at - started, 2),
                    "injected": True,
                    "ready_again_s": None if back is None else round(back, 2),
                    "recovery_s": None if recovery is None else round(recovery, 2),
                    "epoch_changed": (chaos.epoch() or 0) > epoch,  # after poison: a worker failed
                    "worker_rss_mb_before": rss_before,
                }
            )
            print(
                f"{at - started:7.1f} s  {what}: ready again after {back} s, next exact completion after {recovery} s",
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
        memory_end = _worker_memory(launcher)
        restarts = {c.name: c.restarts for c in launcher.children}
    finally:
        stop.set()
        launcher.stop()
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": {
            "completed_exact": outcomes.exact,
            "completed_wrong": outcomes.wrong,
            "failed_with_error": outcomes.failed,
            "hung": outcomes.hung + hung_threads,
        },
        "poison_requests": dict(outcomes.poison),
        "poison_faults_that_changed_the_topology": sum(
            1 for f in faults if f["kind"] == "poison" and f["injected"] and f["epoch_changed"]
        ),
        "errors": dict(outcomes.errors),
        "wrong_examples": outcomes.wrong_examples,
        "faults": faults,
        "faults_injected": sum(f["injected"] for f in faults),
        "faults_not_recovered": sum(1 for f in faults if f["injected"] and f.get("recovery_s") is None),
        "recovery_s": {
            "max": max(recoveries, default=None),
            "mean": round(sum(recoveries) / len(recoveries), 2) if recoveries else None,
        },
        "faults_not_ready_again": sum(1 for f in faults if f["injected"] and f.get("ready_again_s") is None),
        # start: ready, before any traffic; warm: traffic settled, before the first fault (the working set).
        "worker_rss_mb": {"start": memory_start, "warm": memory_warm, "end": memory_end},
        "process_restarts": restarts,
        # Seconds since traffic started at which each traffic request ended, by outcome (the plot's timeline).
        "outcomes_at_s": {kind: [round(t - started, 2) for t in times] for kind, times in outcomes.ended_at.items()},
    }
    result["recovery_by_kind"] = kind_ranges_json(recovery_by_kind(read_faults(result, str(args.out))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    title = f"dejavu bench chaos: {args.minutes:g} min, a fault every {args.interval:g} s, {args.clients} clients"
    plot_chaos(result, png, title, str(args.out))
    r = result["requests"]
    print(
        f"\nchaos: {result['faults_injected']} faults injected ({len(faults) - result['faults_injected']} not) "
        f"in {args.minutes:g} min, {args.clients} clients; "
        f"requests: {r['completed_exact']} exact, {r['completed_wrong']} wrong, "
        f"{r['failed_with_error']} failed with an error, {r['hung']} hung"
    )
    print(
        f"  poison requests: {dict(outcomes.poison)}; poison faults after which the topology changed: "
        f"{result['poison_faults_that_changed_the_topology']}"
    )
    print(f"  {'fault':11s} {'ready again s':28s} next exact completion s")
    for kind in dict.fromkeys(f["kind"] for f in faults):
        mine = [f for f in faults if f["kind"] == kind and f["injected"]]
        ready = ", ".join("-" if f["ready_again_s"] is None else f"{f['ready_again_s']:.1f}" for f in mine)
        exact = ", ".join("-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}" for f in mine)
        print(f"  {kind:11s} {ready:28s} {exact}")
    print(
        f"  worker RSS MB start {memory_start}\n  worker RSS MB warm  {memory_warm}\n  worker RSS MB end   {memory_end}"
    )
    print(f"wrote {args.out}\nwrote {png}")
    poison_ok = outcomes.poison.get("hung", 0) == 0 and result["poison_faults_that_changed_the_topology"] == 0
    return 0 if r["completed_wrong"] == 0 and r["hung"] == 0 and poison_ok else 1


if __name__ == "__main__":
    sys.exit(main())
