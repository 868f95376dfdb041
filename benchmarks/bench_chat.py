"""`dejavu bench chat`: many ordinary chat requests (no ``max_tokens``) through the official client.

Chat clients rarely send ``max_tokens``: each request may then generate up to the model's context, and
a server that reserved memory for that, or batched such requests alone, would serve them one at a
time. This benchmark starts the deployment ``dejavu up`` would start (``--up-args`` passes its options;
default: the planner's choice for this host), sends ``--requests`` streamed chat completions through
the ``openai`` client, ``--concurrency`` at a time, each with short everyday questions, sampling at
``--temperature`` with a per-request seed, and no ``max_tokens``. It reports the completion time,
tokens per second, finish reasons, failures, every worker's RSS after a warm-up (8 requests), half-way and at the
end, and what each worker reports holding once all requests ended (must be nothing). ``--rounds N`` sends the
same requests N times to the same deployment and also records every worker's RSS a few seconds after each
round, once the workers are idle (memory must not grow from round to round). Writes
``benchmarks/results/chat.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*
from benchmarks.procs import free_port, rss_mb, stop_on_sigterm

RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = [
    "Say hello in one short sentence.",
    "What is the capital of Italy?",
    "Give me one word that rhymes with cat.",
    "What is 12 plus 30?",
    "Name a primary color.",
    "Is the sun a star? Answer briefly.",
    "Translate 'thank you' into French.",
    "What day comes after Monday?",
    "Suggest a name for a pet goldfish.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "Write a haiku about rain.",
    "What is the boiling point of water in Celsius?",
    "Recommend a fruit for breakfast.",
    "What is Python in one sentence?",
    "Give me a synonym for happy.",
    "Which planet is known as the red planet?",
    "What should I name my blog about cooking?",
    "Tell me a fun fact about cats.",
    "How do you say good morning in Spanish?",
    "What is the largest ocean on Earth?",
    "List three vegetables.",
    "What is a noun? One sentence please.",
    "Who wrote Romeo and Juliet?",
]


def _memory(launcher) -> dict[str, float | None]:
    return {c.name: rss_mb(c.proc.pid) for c in launcher.children if c.proc is not None}


def _held(redis_url: str) -> dict[str, dict]:
    """What each worker reported holding (caches and replicas) in its last heartbeat."""
    import redis

    from dejavu_common import keys

    client = redis.Redis.from_url(redis_url)
    try:
        return {
            raw.decode(): json.loads(client.get(keys.worker_kv(raw.decode())) or "{}")
            for raw in client.smembers(keys.WORKERS)
        }
    finally:
        client.close()


def _one(client, model: str, question: str, seed: int, temperature: float) -> dict:
    started = time.monotonic()
    record: dict = {"question": question, "seed": seed}
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=temperature,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        first = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.monotonic() - started
            if chunk.choices and chunk.choices[0].finish_reason:
                record["finish_reason"] = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                record["completion_tokens"] = chunk.usage.completion_tokens
                record["prompt_tokens"] = chunk.usage.prompt_tokens
        record["ttft_s"] = first
    except Exception as exc:  # an HTTP or in-stream error fails this request only
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    record["latency_s"] = time.monotonic() - started
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench chat", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--up-args", default="", help="options of `dejavu up` for the deployment (quoted)")
    parser.add_argument("--request-timeout-s", type=float, default=900.0)
    parser.add_argument("--rounds", type=int, default=1, help="send the requests this many times (memory per round)")
    parser.add_argument("--out", type=Path, default=RESULTS / "chat.json")
    args = parser.parse_args(argv)
    stop_on_sigterm()  # stopped, it still stops the deployment it started

    import openai

    from dejavu_cli.commands import up
    from dejavu_cli.launcher import Launcher

    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    up_parser = argparse.ArgumentParser()
    up.register(up_parser.add_subparsers())
    up_argv = ["up", "--port", str(free_port()), "--redis-url", redis_url, *shlex.split(args.up_args)]
    settings = up._settings(up_parser.parse_args(up_argv))
    c = settings.controller
    layout = (
        f"{c.token_depth} colocated stage(s)"
        if c.mode.value == "colocated"
        else f"{c.prompt_depth} prompt + {c.token_depth} token stages"
    )
    rng = random.Random(args.seed)
    work = [(rng.choice(QUESTIONS), rng.randrange(1 << 30)) for _ in range(args.requests)]
    launcher = Launcher(settings, restart_workers=False)
    records: list[dict] = []
    memory: dict[str, dict] = {}
    lock = threading.Lock()
    try:
        launcher.start()
        launcher.wait_ready(300)
        client = openai.OpenAI(
            base_url=launcher.api_url + "/v1", api_key="unused", timeout=args.request_timeout_s, max_retries=0
        )
        model = settings.model.name
        print(f"deployment: {layout}; {args.requests} chat requests, {args.concurrency} at a time", flush=True)
        warmup = work[: min(8, args.concurrency)]  # first-call costs, not counted
        with ThreadPoolExecutor(len(warmup)) as pool:
            list(pool.map(lambda w: _one(client, model, *w, temperature=args.temperature), warmup))
        memory["after_warmup"] = _memory(launcher)
        started = time.monotonic()

        def run(item: tuple[str, int]) -> None:
            record = _one(client, model, *item, temperature=args.temperature)
            with lock:
                records.append(record)
                done = len(records)
                if done == args.requests // 2:
                    memory["half_way"] = _memory(launcher)
                if done % 100 == 0:
                    print(f"  {done} done after {time.monotonic() - started:.0f} s", flush=True)

        idle_wait_s = 3 * settings.recovery.heartbeat_interval_s + 3.0  # beats, and the workers' quiet period
        round_s = []
        for index in range(args.rounds):
            round_started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(run, work))
            round_s.append(round(time.monotonic() - round_started, 1))
            if index == 0:
                memory["end"] = _memory(launcher)
            if args.rounds > 1:
                time.sleep(idle_wait_s)  # idle: freed memory is handed back
                memory[f"round_{index + 1}_idle"] = _memory(launcher)
                print(f"  round {index + 1} done in {round_s[-1]} s; RSS idle {memory[f'round_{index + 1}_idle']}")
        elapsed = sum(round_s)  # sending time only (not the idle waits between rounds)
        time.sleep(2 * settings.recovery.heartbeat_interval_s + 1.0)  # the last heartbeat reports what is held now
        held = _held(redis_url)
    finally:
        launcher.stop()

    ok = [r for r in records if "error" not in r]
    tokens = [r.get("completion_tokens", 0) for r in ok]
    summary = {
        "deployment": layout,
        "requests": args.requests,
        "rounds": args.rounds,
        "round_s": round_s,
        "concurrency": args.concurrency,
        "temperature": args.temperature,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r["error"] for r in records if "error" in r).most_common(5)),
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in ok)),
        "completion_s": round(elapsed, 1),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tok_per_s": round(sum(tokens) / elapsed, 1),
        "completion_tokens": {
            "mean": round(statistics.fmean(tokens), 1) if tokens else None,
            "median": statistics.median(tokens) if tokens else None,
            "max": max(tokens, default=None),
        },
        "latency_s": {
            "median": round(statistics.median(r["latency_s"] for r in ok), 2) if ok else None,
            "p99": round(sorted(r["latency_s"] for r in ok)[int(0.99 * (len(ok) - 1))], 2) if ok else None,
        },
        "worker_rss_mb": memory,
        "held_after": held,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
