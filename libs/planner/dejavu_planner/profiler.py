"""Measure a :class:`Profile` on the real engine (``dejavu profile``).

The only module of the package that imports torch and the engine; the planner and the simulator
never import it. It times one :class:`dejavu_engine.stage.Stage` holding the first ``k`` layers of
the checkpoint (all of them by default) and scales its per-layer times to the whole model, so the
profile reads as measured on one stage holding every layer (``measured_depth = 1``). The head
(final norm, LM head, sampling) is timed on its own and recorded apart, because only a pipeline's
last stage runs it.

``co_runners`` starts that many other processes that decode continuously on the same model while
the times are taken: the condition of a host that several workers share (this project's 2-core
test machines), where they compete for memory bandwidth and caches. 0 measures a machine alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from dejavu_common.messages import SamplingSpec
from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model, model_path
from dejavu_engine.families import family_for
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.sampling import sample
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.threads import configure_torch_threads
from dejavu_engine.weights import load_config
from dejavu_planner.profile import Profile
from dejavu_planner.table import Curve, Grid
from dejavulib.kvcache import KVCache

Progress = Callable[[str], None]
GREEDY = SamplingSpec(max_tokens=1, temperature=0)  # what a profiled last stage samples with (as the workers do)


@dataclass(frozen=True)
class ProfilerOptions:
    """What to measure. With the defaults the default model takes about 1.5 minutes on one CPU thread."""

    batches: tuple[int, ...] = (1, 2, 4)
    prompt_lens: tuple[int, ...] = (32, 128, 256)
    decode_context: int = 128  # cache positions filled before token steps are timed
    decode_steps: int = 8
    repeats: int = 3  # timed runs per point (median), after one warm-up run
    layers: int | None = None  # time a stage of the first `layers` layers; None: all
    machine_memory_bytes: int | None = None  # None: the device's total memory
    host_device_bytes_per_s: float | None = None  # swap bandwidth, if known
    co_runners: int = 0  # processes decoding on the same host while timing (a shared host)
    # Rows of the token steps (and the head) to time; None: ``batches``. The runtime's cohorts batch
    # many microbatches' rows in one step, far beyond the microbatch sizes worth prefilling.
    token_batches: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.batches or not self.prompt_lens or min(*self.batches, *self.prompt_lens) < 1:
            raise ValueError("batches and prompt_lens need positive entries")
        if self.token_batches is not None and (not self.token_batches or min(self.token_batches) < 1):
            raise ValueError("token_batches needs positive entries")

    @property
    def token_rows(self) -> tuple[int, ...]:
        """The token-step row counts to time, increasing."""
        return tuple(sorted(set(self.token_batches or self.batches)))
        if self.repeats < 1 or self.decode_steps < 1 or self.decode_context < 1:
            raise ValueError("repeats, decode_steps and decode_context must be >= 1")
        if self.co_runners < 0:
            raise ValueError("co_runners must be >= 0")


def _synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock times cover them (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores)"


class Profiler:
    """Times prefill and decode of one stage; see :func:`measure_profile`."""

    def __init__(self, settings: Settings, options: ProfilerOptions, progress: Progress | None = None) -> None:
        self.options = options
        self.progress = progress or (lambda _: None)
        configure_torch_threads(settings.engine.torch_threads)
        folder = model_path(settings) if settings.model.path is not None else ensure_default_model(settings)
        spec = family_for(load_config(folder)).spec
        self.model_layers = spec.num_layers
        self.vocab = spec.vocab_size
        k = options.layers or spec.num_layers
        if not 1 <= k <= spec.num_layers:
            raise ValueError(f"layers must be in [1, {spec.num_layers}], got {k}")
        self.stage = Stage(folder, (0, k), device=settings.model.device, dtype=settings.model.dtype)
        self.scale = spec.num_layers / k  # stage time -> whole-model time on one stage
        self.name = settings.model.name
        self.folder = folder
        self.threads = settings.engine.torch_threads
        self.hidden_size = spec.hidden_size
        self.device, self.dtype = settings.model.device, settings.model.dtype
        self._head_cache: dict[int, float] = {}
        # The head lives on the model's last stage: time it there (one extra layer when k < L).
        self.last = (
            self.stage
            if self.stage.is_last
            else Stage(folder, (spec.num_layers - 1, spec.num_layers), settings.model.device, settings.model.dtype)
        )

    def _timed(self, run: Callable[[], object]) -> float:
        """Median seconds of ``repeats`` runs after one warm-up run."""
        run()
        times = []
        for _ in range(self.options.repeats):
            _synchronize(self.stage.device)
            start = time.perf_counter()
            run()
            _synchronize(self.stage.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _inputs(self, batch: int, prompt_len: int, extra: int) -> tuple[KVCache, BatchGeometry, torch.Tensor]:
        """A fresh cache with room for ``extra`` more positions, the prompt geometry and random ids."""
        cache = self.stage.allocate_cache(batch, prompt_len + extra)
        geometry = BatchGeometry.for_prompts([prompt_len] * batch)
        ids = torch.randint(0, self.vocab, (batch, prompt_len), device=self.stage.device)
        return cache, geometry, ids

    def _layers_only(self, stage_seconds: float, batch: int) -> float:
        """Whole-model seconds of the layers alone, from a timed run of ``self.stage``."""
        if self.stage.is_last:  # the timed run included the head
            stage_seconds = max(stage_seconds - self.head_time(batch), 0.0)
        return stage_seconds * self.scale

    def head_time(self, batch: int) -> float:
        """Seconds of what a last stage does after its layers for one step: norm, LM head on the last
        position, greedy sampling (as the token worker does)."""
        cached = self._head_cache.get(batch)
        if cached is not None:
            return cached
        hidden = torch.randn(batch, 1, self.hidden_size, device=self.last.device)
        params = [GREEDY] * batch

        def head() -> None:
            sample(self.last.logits(hidden)[:, -1], params, [0] * batch)

        seconds = statistics.median(self._timed(head) for _ in range(3))  # short: a few repeats more
        self._head_cache[batch] = seconds
        return seconds

    def prompt_time(self, batch: int, prompt_len: int) -> float:
        """Whole-model prefill seconds of one microbatch, the head excluded."""
        cache, geometry, ids = self._inputs(batch, prompt_len, 1)
        seconds = self._timed(lambda: self.stage.prefill(StageIO(input_ids=ids), cache, geometry))
        return self._layers_only(seconds, batch)

    def token_time(self, batch: int) -> float:
        """Whole-model seconds of one decode step at ``decode_context`` filled positions, the head excluded."""
        o = self.options
        total_steps = o.decode_steps * (o.repeats + 1)  # warm-up run included
        cache, geometry, ids = _ready_to_decode(self.stage, batch, o.decode_context, total_steps + 1)
        steps = iter(range(1, total_steps + 1))

        def decode_steps() -> None:
            for _ in range(o.decode_steps):
                self.stage.decode(ids, cache, geometry.advance(next(steps)))

        return self._layers_only(self._timed(decode_steps) / o.decode_steps, batch)

    def member_time(self, batch: int) -> float:
        """Whole-model seconds a grouped decode step spends per microbatch beyond the first: ``batch``
        microbatches of one row each (``Stage.decode_groups``, as the runtime's cohorts run them) against
        one microbatch of ``batch`` rows, at ``decode_context``. 0 when ``batch < 2``; noise below 0 is 0."""
        if batch < 2:
            return 0.0
        o = self.options
        total_steps = o.decode_steps * (o.repeats + 1)  # warm-up run included
        cache, geometry, ids = _ready_to_decode(self.stage, batch, o.decode_context, total_steps + 1)
        singles = [_ready_to_decode(self.stage, 1, o.decode_context, total_steps + 1) for _ in range(batch)]
        single_ids = StageIO(input_ids=torch.cat([s_ids.input_ids for *_, s_ids in singles]))

        def per_step(step: Callable[[int], object]) -> float:
            steps = iter(range(1, total_steps + 1))

            def run() -> None:
                for _ in range(o.decode_steps):
                    step(next(steps))

            return self._timed(run) / o.decode_steps

        together = per_step(lambda s: self.stage.decode(ids, cache, geometry.advance(s)))
        apart = per_step(lambda s: self.stage.decode_groups(single_ids, [(c, g.advance(s)) for c, g, _ in singles]))
        # The head (if this stage has it) sees the same rows either way: the difference is the layers'.
        return max(apart - together, 0.0) * self.scale / (batch - 1)

    def stream_overhead(self, batch: int, prompt_len: int) -> float:
        """``m``: prefill slowdown when each layer's new KV is copied out as soon as it is written.

        This is the local half of DejaVuLib's layer-by-layer streaming (the copy into a send
        buffer); the network half overlaps with compute on other hardware and is not measured.
        """
        cache, geometry, ids = self._inputs(batch, prompt_len, 1)
        out = KVCache.allocate(cache.layout, "cpu")

        def copy_out(layer: int) -> None:
            i = cache.local(layer)
            out.k[i, :, :, :prompt_len].copy_(cache.k[i, :, :, :prompt_len])
            out.v[i, :, :, :prompt_len].copy_(cache.v[i, :, :, :prompt_len])

        plain = self._timed(lambda: self.stage.prefill(StageIO(input_ids=ids), cache, geometry))
        streamed = self._timed(lambda: self.stage.prefill(StageIO(input_ids=ids), cache, geometry, copy_out))
        return streamed / plain

    def weight_bytes_per_layer(self) -> int:
        """``W0``: the stage's decoder-layer bytes per layer plus embeddings/head spread over all layers.

        Non-layer tensors (embeddings; the head when loaded or tied) are counted once, whatever
        number of layers was timed.
        """
        stage = self.stage
        layer_names = {n for i in range(*stage.layers) for n in stage.family.layer_names(i).values()}
        layer_bytes = sum(t.numel() * t.element_size() for n, t in stage.weights.items() if n in layer_names)
        other_bytes = stage.param_bytes - layer_bytes
        return round(layer_bytes / stage.num_layers + other_bytes / self.model_layers)

    def measure(self) -> Profile:
        """Take every measurement (with the co-runners decoding alongside, if any) into a profile."""
        with _co_running(self, self.options.co_runners):
            return self._measure()

    def _measure(self) -> Profile:
        o = self.options
        rows = []
        for b in o.batches:
            rows.append(tuple(self.prompt_time(b, p) for p in o.prompt_lens))
            self.progress(
                f"prompt b={b}: " + ", ".join(f"{p} tok {s:.3f}s" for p, s in zip(o.prompt_lens, rows[-1], strict=True))
            )
        tokens = []
        for b in o.token_rows:
            tokens.append(self.token_time(b))
            self.progress(f"token b={b}: {tokens[-1] * 1000:.1f} ms per step")
        heads = [self.head_time(b) for b in o.token_rows]
        pairs = zip(o.token_rows, heads, strict=True)
        self.progress("head: " + ", ".join(f"b={b} {h * 1000:.1f} ms" for b, h in pairs))
        m_raw = self.stream_overhead(o.batches[len(o.batches) // 2], o.prompt_lens[-1])
        self.progress(f"stream overhead m = {m_raw:.3f}")
        member = self.member_time(o.token_rows[-1])
        self.progress(f"cohort member: {member * 1000:.2f} ms per step per microbatch beyond the first")
        device = self.stage.device
        measured_layers = self.stage.num_layers
        return Profile(
            model=self.name,
            hardware=_hardware_name(device),
            layers=self.model_layers,
            weight_bytes_per_layer=self.weight_bytes_per_layer(),
            kv_bytes_per_token_per_layer=self.stage.kv_layout(1, 1).bytes_per_token_per_layer,
            machine_memory_bytes=o.machine_memory_bytes or _device_memory(device),
            measured_depth=1,
            prompt_time=Grid(tuple(map(float, o.batches)), tuple(map(float, o.prompt_lens)), tuple(rows)),
            token_time=Curve(tuple(map(float, o.token_rows)), tuple(tokens)),
            # Below 1 is timing noise: copying out cannot speed prefill up.
            stream_overhead=max(1.0, m_raw),
            host_device_bytes_per_s=o.host_device_bytes_per_s,
            head_time=Curve(tuple(map(float, o.token_rows)), tuple(heads)),
            co_runners=o.co_runners,
            member_time=member,
            source=(
                f"measured by `dejavu profile` on {device.type} with {torch.get_num_threads()} torch threads, "
                f"stage of layers [0, {measured_layers}) of {self.model_layers} scaled to the whole model; "
                f"median of {o.repeats} runs; token steps at {o.decode_context} cached positions; "
                f"m = {m_raw:.3f} measured (KV copied out per layer); head (norm, LM head, sampling) timed apart; "
                f"cohort member cost from {o.token_rows[-1]} one-row microbatches vs one of {o.token_rows[-1]} rows; "
                f"embeddings folded into the weights per layer; "
                + (f"{o.co_runners} other process(es) decoding on the host meanwhile" if o.co_runners else "host alone")
            ),
        )


def _ready_to_decode(stage: Stage, batch: int, context: int, steps: int) -> tuple[KVCache, BatchGeometry, StageIO]:
    """A cache of ``batch`` random prompts of ``context`` tokens, prefilled, with room for ``steps`` more
    positions; their geometry; and random input ids for a decode step."""
    vocab = stage.spec.vocab_size
    cache = stage.allocate_cache(batch, context + steps)
    geometry = BatchGeometry.for_prompts([context] * batch)
    stage.prefill(StageIO(input_ids=torch.randint(0, vocab, (batch, context), device=stage.device)), cache, geometry)
    return cache, geometry, StageIO(input_ids=torch.randint(0, vocab, (batch, 1), device=stage.device))


def _co_run(folder: str, layers: tuple[int, int], device: str, dtype: str, threads: int, batch: int, context: int,
            ready, stop) -> None:  # fmt: skip
    """A co-runner process: decode steps of one microbatch, round and round, until ``stop`` is set."""
    configure_torch_threads(threads)
    stage = Stage(Path(folder), layers, device=device, dtype=dtype)
    laps = 64
    cache, geometry, ids = _ready_to_decode(stage, batch, context, laps)
    step = 0
    while not stop.is_set():
        step = step % laps + 1  # rewrite the same positions: the cost of a step at about ``context``
        out = stage.decode(ids, cache, geometry.advance(step))
        if stage.is_last:
            sample(out.logits[:, -1], [GREEDY] * batch, [step] * batch)
        ready.set()


@contextmanager
def _co_running(profiler: Profiler, count: int) -> Iterator[None]:
    """Run ``count`` co-runner processes (the profiled stage's layers, decoding) around the block.

    Every process is stopped and joined on the way out, killed if it does not stop in time.
    """
    if count == 0:
        yield
        return
    ctx = mp.get_context("spawn")  # a fresh interpreter: no torch state or threads inherited
    stop = ctx.Event()
    o = profiler.options
    procs: list = []
    try:
        for _ in range(count):
            ready = ctx.Event()
            args = (str(profiler.folder), profiler.stage.layers, profiler.device, profiler.dtype, profiler.threads,
                    o.batches[len(o.batches) // 2], o.decode_context, ready, stop)  # fmt: skip
            proc = ctx.Process(target=_co_run, args=args, daemon=True, name="dejavu-profile-co-runner")
            proc.start()
            procs.append((proc, ready))
        for proc, ready in procs:
            deadline = time.monotonic() + 300
            while not ready.wait(0.5):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"a profiling co-runner did not start (exit code {proc.exitcode})")
        profiler.progress(f"{count} co-runner process(es) decoding alongside")
        yield
    finally:
        stop.set()
        for proc, _ in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def measure_profile(settings: Settings, options: ProfilerOptions, progress: Progress | None = None) -> Profile:
    """Load the configured model (the prepared default if ``model.path`` is unset) and measure it.

    Blocks for the whole measurement (about 1.5 minutes on one CPU thread with the defaults).
    Raises the engine's ``CheckpointError`` when no checkpoint is available.
    """
    return Profiler(settings, options, progress).measure()
