"""The token budget of a deployment (``engine.token_budget``): how many positions one pass computes at most.

A pass of a request-scheduled pipeline (``dejavu_common.sched``) runs the running requests' decodes first, at most
``ceil(max_running / depth)`` of them, then prompt chunks up to the budget. A larger budget prefills faster (fewer
passes per prompt, each amortizing its fixed costs over more positions) and makes every pass longer, and with it
the time between two tokens of every streaming request. :func:`size_token_budget` picks, from the profile and an
inter-token latency target (``planner.itl_target_ms``), the largest budget that is

* **legal**: a multiple of the KV block size that holds a full pass's decodes and one block of prompt;
* **within the target**: a request in a pipeline of ``depth`` stages, with ``depth`` passes in flight, gets a
  token every ``depth`` passes of the slowest stage; a full pass is the decodes and, for the rest of the budget,
  a prompt's first chunk (which samples its first token), costed as the simulator costs it
  (:meth:`CostModel.pass_stage_time`);
* **not past the knee**: at most :data:`KNEE_HEADROOM` times the profile's prefill knee (:func:`prefill_knee`) in
  prompt positions a pass.

Where even the smallest legal budget misses the target, that budget is chosen with a warning: only fewer decodes
a pass (``controller.max_running``), more stages or a faster host can meet it. In a disaggregated deployment the
token pipeline's passes are decodes only and the prompt pipeline packs prompts by tokens in passes that delay no
stream: the knee alone sizes the budget there, and the target is checked against the decodes' pass.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from dejavu_common.sched import Budget
from dejavu_common.settings import PlannerSettings
from dejavu_planner.costmodel import CostModel, split_layers
from dejavu_planner.profile import Profile

KNEE_GAIN = 0.05  # prefill throughput gaining less than this per doubling of the chunk has flattened
# A pass computes at most this many times the knee in prompt positions. The knee is the first measured length
# after which a doubling gains under KNEE_GAIN, so twice the knee takes all of that last doubling's gain and no
# more; the doubling also covers what the profile cannot see, each pass's fixed costs outside its compute (the
# scheduler, the pass's messages), which longer chunks amortize. Past it a pass only grows longer.
KNEE_HEADROOM = 2
MIN_TOKENS = 16  # engine.token_budget's bounds
MAX_TOKENS = 1 << 20
DEFAULT_ITL_TARGET_S = PlannerSettings().itl_target_ms / 1000


class Bound(enum.StrEnum):
    """What stopped the budget from growing."""

    TARGET = "target"  # one block more would miss the inter-token latency target
    KNEE = "knee"  # KNEE_HEADROOM times the prefill knee in prompt positions
    MINIMUM = "minimum"  # the smallest legal budget (the target may be missed: see the warning)


@dataclass(frozen=True)
class Knee:
    """Where prefill throughput (positions a second of one prompt chunk) stops improving: ``positions``, a
    measured prompt length; ``measured`` False when it still improves at the profile's longest one."""

    positions: int
    measured: bool


@dataclass(frozen=True)
class TokenBudget:
    """The chosen budget and what it costs: ``pass_s`` is a full pass of the decoding pipeline (``decodes`` decodes
    and, ``colocated``, the rest of ``tokens`` as a prompt chunk) on its slowest of ``depth`` stages; ``next_s`` is
    that pass one block larger, where the target stopped the budget."""

    tokens: int
    block_size: int
    decodes: int
    depth: int
    colocated: bool
    pass_s: float
    target_s: float
    knee: Knee
    bound: Bound
    next_s: float | None = None

    @property
    def itl_s(self) -> float:
        """A streaming request's time between tokens: ``depth`` passes of the slowest stage."""
        return self.depth * self.pass_s

    @property
    def warning(self) -> str | None:
        """Why no budget meets the target, or None where the chosen one does."""
        if self.itl_s <= self.target_s:
            return None
        return (
            f"no token budget meets the inter-token latency target of {_s(self.target_s)} (planner.itl_target_ms): "
            f"{self._what()} takes {_s(self.itl_s)} between a request's tokens; running with {self.tokens} "
            "positions a pass. Raise the target, or plan fewer decodes a pass (controller.max_running), more "
            "stages or a faster host."
        )

    def why(self) -> str:
        """One paragraph: the budget, the pass time it gives against the target, and what bound it."""
        cost = (
            f"{self._what()} takes {_s(self.pass_s)} on the slowest stage, {_s(self.itl_s)} between a request's "
            f"tokens with {self.depth} pass(es) in flight, against a target of {_s(self.target_s)} "
            "(planner.itl_target_ms)"
        )
        if self.bound is Bound.TARGET:
            bound = f"{self.tokens + self.block_size} positions would take {_s(self.depth * (self.next_s or 0.0))}"
        elif self.bound is Bound.KNEE:
            where = "the prompt pipeline's passes delay no stream, so " if not self.colocated else ""
            bound = f"{where}prompt positions a pass stop at {KNEE_HEADROOM} x the knee"
        else:
            bound = "it is the smallest budget that holds the decodes and one block of prompt"
        knee = (
            f"prefill throughput's knee is {self.knee.positions} positions (a doubling past it gains under "
            f"{KNEE_GAIN:.0%})"
            if self.knee.measured
            else f"the profile shows no prefill knee up to its longest prompt, {self.knee.positions} positions"
        )
        return f"token budget {self.tokens} positions a pass ({self.bound} bound): {cost}; {bound}; {knee}."

    def _what(self) -> str:
        if not self.colocated:
            return f"a token pass of {self.decodes} decodes"
        return f"a full pass ({self.decodes} decodes, {self.tokens - self.decodes} prompt positions)"


def prefill_knee(profile: Profile, gain: float = KNEE_GAIN) -> Knee:
    """The first of the profile's measured prompt lengths after which prefill throughput (positions a second of one
    prompt) gains less than ``gain`` per doubling of the length, up to the next measured length: measured points
    only, so a noisy or coarse grid is not read between its points. Without one, the longest measured length."""
    lengths = [int(p) for p in profile.prompt_time.y if p >= 1]
    if not lengths:
        raise ValueError(f"profile {profile.model!r} measures no prompt of a position or more")
    rates = [p / max(profile.prompt_layer_time(1, p), 1e-12) for p in lengths]
    for i in range(len(lengths) - 1):
        doublings = math.log2(lengths[i + 1] / lengths[i])
        if (rates[i + 1] / rates[i]) ** (1 / doublings) - 1 < gain:
            return Knee(lengths[i], measured=True)
    return Knee(lengths[-1], measured=False)


def full_pass_time(cost: CostModel, depth: int, decodes: int, prompt: int) -> float:
    """A pass of ``decodes`` decodes and one prompt's first chunk of ``prompt`` positions (which samples its first
    token) on the slowest stage of a ``depth``-stage pipeline (the last stage runs the head too)."""
    chunks = ((0, prompt),) if prompt > 0 else ()
    sampling = decodes + (1 if prompt > 0 else 0)
    layers = split_layers(cost.layers, depth)
    return max(
        cost.pass_stage_time(n, decodes, chunks, sampling, last=i == len(layers) - 1) for i, n in enumerate(layers)
    )


def size_token_budget(
    cost: CostModel,
    depth: int,
    max_running: int,
    itl_target_s: float = DEFAULT_ITL_TARGET_S,
    block_size: int = 16,
    colocated: bool = True,
) -> TokenBudget:
    """The token budget of a deployment whose decoding pipeline has ``depth`` stages (the colocated pipeline, or
    the token pipeline when not ``colocated``) and decodes up to ``max_running`` requests (see the module's
    docstring). Raises ``ValueError`` on a target or size out of range."""
    if itl_target_s <= 0 or depth < 1 or max_running < 1 or block_size < 1:
        raise ValueError("itl_target_s, depth, max_running and block_size must be positive")
    decodes = Budget(tokens=MAX_TOKENS, max_running=max_running, depth=depth).decodes_per_pass
    smallest = _round_up(max(decodes + block_size, MIN_TOKENS), block_size)
    if smallest > MAX_TOKENS:
        raise ValueError(f"{decodes} decodes a pass exceed the largest token budget, {MAX_TOKENS}")
    knee = prefill_knee(cost.profile)
    prompt_cap = KNEE_HEADROOM * knee.positions

    def chosen(tokens: int, pass_s: float, bound: Bound, next_s: float | None = None) -> TokenBudget:
        return TokenBudget(tokens, block_size, decodes, depth, colocated, pass_s, itl_target_s, knee, bound, next_s)

    if not colocated:
        tokens = max(smallest, min(_round_down(prompt_cap, block_size), MAX_TOKENS))
        return chosen(
            tokens, full_pass_time(cost, depth, decodes, 0), Bound.KNEE if tokens > smallest else Bound.MINIMUM
        )
    cap = max(smallest, min(_round_down(decodes + prompt_cap, block_size), MAX_TOKENS))
    tokens, pass_s = smallest, full_pass_time(cost, depth, decodes, smallest - decodes)
    if depth * pass_s > itl_target_s or cap == smallest:
        return chosen(tokens, pass_s, Bound.MINIMUM)
    while tokens < cap:  # pass times grow with the budget: the first one past the target ends the search
        next_s = full_pass_time(cost, depth, decodes, tokens + block_size - decodes)
        if depth * next_s > itl_target_s:
            return chosen(tokens, pass_s, Bound.TARGET, next_s)
        tokens, pass_s = tokens + block_size, next_s
    return chosen(tokens, pass_s, Bound.KNEE)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _round_down(n: int, block: int) -> int:
    return n // block * block


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
