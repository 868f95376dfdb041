"""`dejavu bench failure`: the paper's failure experiment (its Figures 13-14), scaled to this machine.

A colocated pipeline of 4 token stages serves the default model; one microbatch (prompt of
``--prompt-len`` tokens, ``--tokens`` generated, greedy) streams while a middle stage is SIGKILLed
part-way. Four runs in one invocation:

- ``no-failure``          replication on, nothing killed (the reference);
- ``no-failure-norepl``   replication off, nothing killed (the cost of replication);
- ``dejavu``              replication on, stage 1 killed: the pipeline resumes from the replicas;
- ``restart``             replication off, stage 1 killed: the microbatch re-runs from its prompt.

Prints a table and writes ``benchmarks/results/failure.json`` and ``failure.png`` (cumulative latency of
the microbatch's tokens). The recovery phases come from the controller's metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*
from benchmarks.procs import free_port, stop_on_sigterm

RESULTS = Path(__file__).resolve().parent / "results"


def _prompt(tokenizer, n: int) -> str:
    """A text of exactly ``n`` tokens."""
    words = ("the quick brown fox jumps over the lazy dog while the river runs to the sea " * (n // 4 + 8)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the shortest word prefix with >= n tokens
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) >= n:
            hi = mid
        else:
            lo = mid + 1
    ids = tokenizer.encode(" ".join(words[:lo]))[:n]
    text = tokenizer.decode(ids)
    assert len(tokenizer.encode(text)) == n, "could not build a prompt of the requested length"
    return text


def _stream(api: str, model: str, prompt: str, tokens: int, out: dict, key: str) -> None:
    """Stream one completion; records the arrival time of every text chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    start = time.monotonic()
    arrivals, text = [], []
    out[key] = {"arrivals": arrivals, "start": start}  # filled while streaming: the killer watches it
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                arrivals.append(time.monotonic() - start)
                text.append(chunk["choices"][0]["text"])
    out[key]["text"] = "".join(text)


def _metrics(api: str) -> dict[str, float]:
    """Sum of each recovery phase's observations (one failure per run)."""
    text = httpx.get(api + "/metrics", timeout=10).text
    phases = {}
    for m in re.finditer(r'dejavu_recovery_phase_seconds_sum\{phase="([a-z_]+)"\} ([0-9.e+-]+)', text):
        phases[m.group(1)] = float(m.group(2))
    return phases


def run_once(name: str, replication: bool, kill: bool, args, model_folder: Path, prompt: str) -> dict:
    from dejavu_cli.launcher import Launcher
    from dejavu_common.settings import Mode, Replication, Settings

    base = Settings()
    settings = base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"}),
            "model": base.model.model_copy(update={"path": model_folder}),
            "engine": base.engine.model_copy(update={"torch_threads": 1}),
            "controller": base.controller.model_copy(
                update={
                    "port": free_port(),
                    "mode": Mode.COLOCATED,
                    "token_depth": 4,
                    "token_microbatch": 2,
                    "batch_wait_ms": 200.0,
                }
            ),
            "recovery": base.recovery.model_copy(
                update={"replication": Replication.MEMORY if replication else Replication.OFF}
            ),
        }
    )
    launcher = Launcher(settings, spares=1, restart_workers=False)
    out: dict = {}
    try:
        launcher.start()
        launcher.wait_ready(300)
        api = launcher.api_url
        threads = [
            threading.Thread(target=_stream, args=(api, settings.model.name, prompt, args.tokens, out, k))
            for k in ("a", "b")
        ]
        for t in threads:
            t.start()
        kill_at = None
        if kill:
            # Kill once about --kill-fraction of the microbatch's tokens have arrived.
            target = max(1, int(args.tokens * args.kill_fraction))
            while threads[0].is_alive() and len(out.get("a", {}).get("arrivals", ())) < target:
                time.sleep(0.005)
            victim = launcher.child("t1").proc
            kill_at, kill_wall = time.monotonic(), time.time()
            os.kill(victim.pid, signal.SIGKILL)
        for t in threads:
            t.join(900)
        phases = _metrics(api) if kill else {}
        detected = _detection(launcher, kill_wall) if kill else None
    finally:
        launcher.stop()
    a = out["a"]
    total = a["arrivals"][-1]
    result = {
        "name": name,
        "replication": replication,
        "killed": kill,
        "tokens": len(a["arrivals"]),
        "latency_s": total,
        "arrivals": a["arrivals"],
        "text": a["text"],
    }
    if kill:
        result["kill_after_s"] = kill_at - a["start"]
        result["detection_s"] = detected
        result["phases_after_detection_s"] = phases
    return result


def _detection(launcher, kill_wall: float) -> float | None:
    """Seconds from the kill to the controller's 'lost' log line (same host, same clock)."""
    import datetime

    log = (launcher.log_dir / "controller.log").read_text()
    m = re.search(r"^(\d+-\d+-\d+ \d+:\d+:\d+,\d+) controller dejavu.controller WARNING lost", log, re.M)
    if m is None:
        return None
    lost = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return lost - kill_wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench failure", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--kill-fraction", type=float, default=0.5, help="kill after this share of the tokens")
    parser.add_argument("--runs", default="no-failure,no-failure-norepl,dejavu,restart")
    args = parser.parse_args(argv)
    stop_on_sigterm()  # stopped, it still stops the deployment it started

    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.checkpoint import ensure_default_model

    model = ensure_default_model(Settings())
    prompt = _prompt(Tokenizer.from_pretrained(model), args.prompt_len)
    plans = {
        "no-failure": (True, False),
        "no-failure-norepl": (False, False),
        "dejavu": (True, True),
        "restart": (False, True),
    }
    results = {}
    for name in args.runs.split(","):
        replication, kill = plans[name]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run_once(name, replication, kill, args, model, prompt)

    base = results.get("no-failure")
    print(
        f"\nfailure benchmark: colocated 4-stage pipeline, prompt {args.prompt_len}, {args.tokens} tokens, "
        f"stage 1 SIGKILLed after ~{args.kill_fraction:.0%} of the tokens"
    )
    print(f"{'run':20s} {'tokens':>6s} {'latency s':>10s} {'x no-failure':>13s}  same text")
    for name, r in results.items():
        ratio = r["latency_s"] / base["latency_s"] if base else float("nan")
        same = (r["text"] == base["text"]) if base else None
        print(f"{name:20s} {r['tokens']:6d} {r['latency_s']:10.2f} {ratio:13.2f}  {same}")
        if r.get("killed"):
            print(
                f"    detection {r['detection_s']:.2f} s after the kill; after detection: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases_after_detection_s"].items())
            )
    if "no-failure-norepl" in results and base:
        cost = base["latency_s"] / results["no-failure-norepl"]["latency_s"] - 1
        print(f"replication cost without failures: {cost:+.1%} latency")

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "failure.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    _plot(results, RESULTS / "failure.png")
    print(f"wrote {RESULTS / 'failure.json'} and {RESULTS / 'failure.png'}")
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["arrivals"]) + 1), r["arrivals"], label=name)
    ax.set_xlabel("token")
    ax.set_ylabel("cumulative latency (s)")
    ax.set_title("One microbatch through a 4-stage pipeline, stage 1 killed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
