"""Stage times and stage memory derived from a profile, for any pipeline depth.

A pipeline of depth ``D`` splits the ``L`` layers into contiguous stages whose sizes differ by
at most one (the first stages take the extra layers). A stage's time is its layer count times
the profile's per-layer time, plus the head on the last stage when the profile times it apart;
its memory is its weights plus the KV caches resident on it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dejavu_common import partition
from dejavu_planner.profile import Profile


class StageRole(enum.StrEnum):
    """What a stage does, which decides which KV caches it must hold."""

    PROMPT = "prompt"  # DejaVu prompt stage: one prompt's KV, streamed out as it is produced
    TOKEN = "token"  # DejaVu token stage, or a baseline stage doing both phases


def split_layers(layers: int, depth: int) -> tuple[int, ...]:
    """Layer counts of the ``depth`` stages (the serving system's split, larger ones first)."""
    return tuple(b - a for a, b in partition.split_layers(layers, depth))


@dataclass(frozen=True)
class CostModel:
    """Times (seconds) and sizes (bytes) of stages of one profiled model."""

    profile: Profile

    @property
    def layers(self) -> int:
        return self.profile.layers

    def prompt_stage_time(self, stage_layers: int, batch: int, prompt_len: int, last: bool = False) -> float:
        """Compute time of one prompt microbatch on a stage of ``stage_layers`` layers (no streaming);
        ``last``: the pipeline's last stage, which also runs the head."""
        head = self.profile.head_step_time(batch) if last else 0.0
        return stage_layers * self.profile.prompt_layer_time(batch, prompt_len) + head

    def token_stage_time(self, stage_layers: int, batch: int, last: bool = False) -> float:
        """Compute time of one token step of a microbatch on a stage of ``stage_layers`` layers."""
        head = self.profile.head_step_time(batch) if last else 0.0
        return stage_layers * self.profile.token_layer_time(batch) + head

    def cohort_step_time(
        self, stage_layers: int, members: Sequence[tuple[int, int]], last: bool = False, swap: bool = False
    ) -> float:
        """One step of a cohort on a stage: ``members`` are its microbatches as ``(rows, context)``.

        The step batches the members' rows it computes (their unfinished rows), so its compute is one
        token step of ``sum(rows)`` rows, plus the profile's ``member_time`` per member beyond the
        first (what each further microbatch adds to a step, as the profiler measured it). Attention
        runs per member over its own context, but the profile times token steps at one context (the
        profiler's ``decode_context``), so contexts enter only the swap-in: with ``swap`` the step lasts
        ``max(compute, swap-in of every member's KV)``, as :meth:`swap_in_time` for one microbatch.
        """
        rows = sum(r for r, _ in members)
        extra = stage_layers * self.profile.member_layer_time() * max(len(members) - 1, 0)
        compute = self.token_stage_time(stage_layers, rows, last) + extra
        if not swap:
            return compute
        return max(compute, sum(self.swap_in_time(stage_layers, r, context) for r, context in members))

    def pass_stage_time(
        self, stage_layers: int, decodes: int, chunks: Sequence[tuple[int, int]], sampling: int, last: bool = False
    ) -> float:
        """One per-request pass (``dejavu_common.sched``) on a stage of ``stage_layers`` layers: its ``decodes``
        batched as one token step of that many rows; each prompt chunk ``(start, length)`` as the profile's prompt
        time of ``start + length`` positions less that of ``start`` (its attention over its cached prefix is in
        it); on the last stage (``last``) the head for its ``sampling`` rows."""
        time = stage_layers * self.profile.token_layer_time(decodes) if decodes else 0.0
        for start, length in chunks:
            before = self.profile.prompt_layer_time(1, start) if start > 0 else 0.0
            time += stage_layers * max(self.profile.prompt_layer_time(1, start + length) - before, 0.0)
        return time + (self.profile.head_step_time(sampling) if last and sampling else 0.0)

    def swap_in_time(self, stage_layers: int, batch: int, context: int) -> float:
        """Time to bring a microbatch's KV (``context`` positions) for the stage's layers back from the host.

        The paper's ``transf_i = i B C / pciebw`` (Appendix "microbatch swapping").
        """
        bandwidth = self.profile.host_device_bytes_per_s
        if bandwidth is None:
            raise ValueError(f"profile {self.profile.model!r} has no host_device_bytes_per_s: cannot swap")
        return stage_layers * batch * context * self.profile.kv_bytes_per_token_per_layer / bandwidth

    def prompt_time_at(self, depth: int, batch: int, prompt_len: int) -> float:
        """The paper's ``Y`` at depth ``D``: prompt time of one stage holding ``L / D`` layers (plus the
        head, which makes the last stage the bottleneck, when the profile times it apart)."""
        layers = self.layers / depth * self.profile.prompt_layer_time(batch, prompt_len)
        return layers + self.profile.head_step_time(batch)

    def token_time_at(self, depth: int, batch: int) -> float:
        """The paper's ``t`` at depth ``D``: token-step time of one stage holding ``L / D`` layers (and the head)."""
        return self.layers / depth * self.profile.token_layer_time(batch) + self.profile.head_step_time(batch)

    def cohort_time_at(self, depth: int, rows: int, members: int) -> float:
        """One cohort pass of ``rows`` rows in ``members`` microbatches on the slowest stage of ``L / D`` layers:
        ``t`` of that many rows plus the profile's member time for each member beyond the first."""
        extra = self.layers / depth * self.profile.member_layer_time() * max(members - 1, 0)
        return self.token_time_at(depth, rows) + extra

    def swapped_token_time_at(self, depth: int, batch: int, context: int) -> float:
        """``t`` with swapping: ``max(t, transfer)`` of a stage of ``L / D`` layers at ``context`` positions."""
        transfer = self.swap_in_time(1, batch, context) * self.layers / depth
        return max(self.token_time_at(depth, batch), transfer)

    def weights_per_layer(self) -> int:
        """``W0``."""
        return self.profile.weight_bytes_per_layer

    def kv_per_layer(self, batch: int, positions: int) -> int:
        """KV bytes of one layer for a microbatch of ``batch`` sequences of ``positions`` tokens (``C0``, ``K0``)."""
        return batch * positions * self.profile.kv_bytes_per_token_per_layer

    def stage_memory(
        self, role: StageRole, stage_layers: int, batch: int, prompt_len: int, max_new: int, resident: int
    ) -> int:
        """Bytes a stage needs: weights plus the KV it keeps resident.

        A prompt stage holds one microbatch's prompt KV (``C0``) per layer. A token stage holds
        ``resident`` microbatches' caches preallocated for prompt plus the longest generation
        (``C0 + K0``): all in-flight microbatches, or two when swapping.
        """
        weights = stage_layers * self.weights_per_layer()
        if role is StageRole.PROMPT:
            return weights + stage_layers * self.kv_per_layer(batch, prompt_len)
        return weights + resident * stage_layers * self.kv_per_layer(batch, prompt_len + max_new)

    def fits_rows(self, depth: int, rows: int, positions: int) -> bool:
        """Whether every stage of a ``depth``-stage pipeline holds its layers and the KV of ``rows``
        sequences of ``positions`` positions each: the serving runtime's token stages, whose caches
        grow as tokens are written, at worst every dispatched request at its longest."""
        if not 1 <= depth <= self.layers:
            return False
        fullest = math.ceil(self.layers / depth)
        need = fullest * (self.weights_per_layer() + self.kv_per_layer(rows, positions))
        return need <= self.profile.machine_memory_bytes

    def fits(self, role: StageRole, depth: int, batch: int, prompt_len: int, max_new: int, swap: bool = False) -> bool:
        """Whether every stage of a ``depth``-stage pipeline fits in one machine's memory.

        A token pipeline keeps ``depth`` microbatches in flight; with swapping only
        ``min(2, depth)`` of them are resident (the one running and the one being prefetched).
        """
        if not 1 <= depth <= self.layers:
            return False
        resident = min(2, depth) if swap else depth
        fullest = math.ceil(self.layers / depth)
        need = self.stage_memory(role, fullest, batch, prompt_len, max_new, resident)
        return need <= self.profile.machine_memory_bytes
