"""Measure a :class:`Profile` on the real engine (``dejavu profile``).

The only module of the package that imports torch and the engine; the planner and the simulator
never import it. It times one :class:`dejavu_engine.stage.Stage` holding the first ``k`` layers of
the checkpoint (all of them by default) and scales its per-layer times to the whole model, so the
profile reads as measured on one stage holding every layer (``measured_depth = 1``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model, model_path
from dejavu_engine.families import family_for
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.kv_cache import KVCache
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.threads import configure_torch_threads
from dejavu_engine.weights import load_config
from dejavu_planner.profile import Profile
from dejavu_planner.table import Curve, Grid

Progress = Callable[[str], None]


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

    def __post_init__(self) -> None:
        if not self.batches or not self.prompt_lens or min(*self.batches, *self.prompt_lens) < 1:
            raise ValueError("batches and prompt_lens need positive entries")
        if self.repeats < 1 or self.decode_steps < 1 or self.decode_context < 1:
            raise ValueError("repeats, decode_steps and decode_context must be >= 1")


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

    def prompt_time(self, batch: int, prompt_len: int) -> float:
        """Whole-model prefill seconds of one microbatch."""
        cache, geometry, ids = self._inputs(batch, prompt_len, 1)
        return self._timed(lambda: self.stage.prefill(StageIO(input_ids=ids), cache, geometry)) * self.scale

    def token_time(self, batch: int) -> float:
        """Whole-model seconds of one decode step at ``decode_context`` filled positions."""
        o = self.options
        total_steps = o.decode_steps * (o.repeats + 1)  # warm-up run included
        cache, geometry, prompt = self._inputs(batch, o.decode_context, total_steps + 1)
        self.stage.prefill(StageIO(input_ids=prompt), cache, geometry)
        ids = torch.randint(0, self.vocab, (batch, 1), device=self.stage.device)
        steps = iter(range(1, total_steps + 1))

        def decode_steps() -> None:
            for _ in range(o.decode_steps):
                self.stage.decode(StageIO(input_ids=ids), cache, geometry.advance(next(steps)))

        return self._timed(decode_steps) / o.decode_steps * self.scale

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
        o = self.options
        rows = []
        for b in o.batches:
            rows.append(tuple(self.prompt_time(b, p) for p in o.prompt_lens))
            self.progress(
                f"prompt b={b}: " + ", ".join(f"{p} tok {s:.3f}s" for p, s in zip(o.prompt_lens, rows[-1], strict=True))
            )
        tokens = []
        for b in o.batches:
            tokens.append(self.token_time(b))
            self.progress(f"token b={b}: {tokens[-1] * 1000:.1f} ms per step")
        m_raw = self.stream_overhead(o.batches[len(o.batches) // 2], o.prompt_lens[-1])
        self.progress(f"stream overhead m = {m_raw:.3f}")
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
            token_time=Curve(tuple(map(float, o.batches)), tuple(tokens)),
            # Below 1 is timing noise: copying out cannot speed prefill up.
            stream_overhead=max(1.0, m_raw),
            host_device_bytes_per_s=o.host_device_bytes_per_s,
            source=(
                f"measured by `dejavu profile` on {device.type} with {torch.get_num_threads()} torch threads, "
                f"stage of layers [0, {measured_layers}) of {self.model_layers} scaled to the whole model; "
                f"median of {o.repeats} runs; token steps at {o.decode_context} cached positions; "
                f"m = {m_raw:.3f} measured (KV copied out per layer); embeddings folded into the weights per layer"
            ),
        )


def measure_profile(settings: Settings, options: ProfilerOptions, progress: Progress | None = None) -> Profile:
    """Load the configured model (the prepared default if ``model.path`` is unset) and measure it.

    Blocks for the whole measurement (about 1.5 minutes on one CPU thread with the defaults).
    Raises the engine's ``CheckpointError`` when no checkpoint is available.
    """
    return Profiler(settings, options, progress).measure()
