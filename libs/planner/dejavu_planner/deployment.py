"""A deployment: which policy runs on how many machines, with which pipelines and microbatches."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Policy(enum.StrEnum):
    """How machines are used; see the paper's Evaluation ("Baselines") and Appendix C."""

    # Original FasterTransformer: a batch of `depth` microbatches runs until its longest request
    # ends; no new microbatch starts before the whole batch has left the last stage.
    FASTER_TRANSFORMER = "ft"
    # The paper's modified FasterTransformer: a finished microbatch is replaced by the next one.
    # With replicas > 1 this is "Baseline-DP" (data-parallel pipelines).
    BASELINE = "baseline"
    # Separate prompt and token pipelines; prompt KV caches are streamed between them.
    DEJAVU = "dejavu"


class Batching(enum.StrEnum):
    """How a token pipeline batches its work; independent of :class:`Policy`'s use of machines."""

    # The paper: a pipeline keeps `depth` microbatches in flight, each holding its slot (and its
    # preallocated cache) from its prompt until its longest request ends.
    MICROBATCH = "microbatch"
    # The serving runtime (services/token_worker driver.py): the token pipeline keeps `depth` cohorts
    # in flight, round-robin; a cohort's member microbatches change at each of its step boundaries
    # (finished microbatches leave, prompt-done ones join the lightest cohort, up to
    # ceil(max_running / depth) rows each), and the controller dispatches by unfinished requests.
    COHORT = "cohort"
    # Per-request passes (dejavu_common.sched): each pass of the decoding pipeline takes running requests' decodes
    # and prompt chunks, then new requests, under a token budget and the KV pool's blocks; no microbatches.
    BUDGET = "budget"


DEFAULT_MAX_RUNNING = 64  # the runtime's controller.max_running default
DEFAULT_TOKEN_BUDGET = 256  # budget: positions per pass (engine.token_budget's default)


@dataclass(frozen=True)
class Deployment:
    """One configuration of machines.

    For the baselines ``depth`` is each pipeline's depth and ``replicas`` the number of
    pipelines; for DejaVu ``depth`` is the prompt pipeline's (``D_p``) and ``token_depth`` the
    token pipeline's (``D_t``). ``microbatch`` is the requests per microbatch in every
    pipeline; ``swap`` keeps in-flight token microbatches' KV in host memory.

    ``batching`` is the paper's microbatch policy or the serving runtime's cohorts; with cohorts
    ``max_running`` is the runtime's ``controller.max_running`` (requests the token pipeline decodes
    at once, ``ceil(max_running / D_t)`` rows per cohort). Cohorts run on the DejaVu policy or on one
    colocated baseline pipeline (the runtime's colocated mode), never under FasterTransformer.
    """

    policy: Policy
    depth: int
    microbatch: int
    token_depth: int = 0
    replicas: int = 1
    swap: bool = False
    batching: Batching = Batching.MICROBATCH
    max_running: int = DEFAULT_MAX_RUNNING
    token_budget: int = DEFAULT_TOKEN_BUDGET  # budget: positions one pass computes at most
    block_size: int = 16  # budget: positions per KV block
    kv_blocks: int = 0  # budget: the KV pool's blocks per stage (0: from the profile's memory)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.microbatch < 1 or self.replicas < 1:
            raise ValueError(f"invalid deployment {self}: depth, microbatch and replicas must be >= 1")
        if (self.policy is Policy.DEJAVU) != (self.token_depth >= 1):
            raise ValueError("token_depth >= 1 is required for, and only for, the dejavu policy")
        if self.policy is Policy.DEJAVU and self.replicas != 1:
            raise ValueError("dejavu deployments have one prompt and one token pipeline (replicas = 1)")
        if self.max_running < 1:
            raise ValueError(f"invalid deployment {self}: max_running must be >= 1")
        if self.cohorts and (self.policy is Policy.FASTER_TRANSFORMER or self.replicas != 1):
            raise ValueError("cohort batching runs on dejavu or on one colocated baseline pipeline")
        if self.budgeted and (self.policy is Policy.FASTER_TRANSFORMER or self.replicas != 1 or self.swap):
            raise ValueError("budgeted passes run on dejavu or on one colocated baseline pipeline, without swapping")
        if self.token_budget < 1 or self.block_size < 1 or self.kv_blocks < 0:
            raise ValueError(f"invalid deployment {self}: token_budget and block_size >= 1, kv_blocks >= 0")

    @property
    def cohorts(self) -> bool:
        """Whether the token pipeline batches in cohorts (the serving runtime's policy)."""
        return self.batching is Batching.COHORT

    @property
    def budgeted(self) -> bool:
        """Whether the decoding pipeline runs per-request passes under a token budget (dejavu_common.sched)."""
        return self.batching is Batching.BUDGET

    @property
    def cohort_depth(self) -> int:
        """Stages of the pipeline that decodes, hence cohorts in flight (``D_t``, or the colocated depth)."""
        return self.token_depth if self.policy is Policy.DEJAVU else self.depth

    @property
    def cohort_rows(self) -> int:
        """The runtime's row cap per cohort: ``ceil(max_running / cohorts)``."""
        return -(-self.max_running // self.cohort_depth)

    @property
    def machines(self) -> int:
        if self.policy is Policy.DEJAVU:
            return self.depth + self.token_depth
        return self.depth * self.replicas

    def notation(self) -> str:
        """The paper's table notation: ``(Yp, Zb)``, ``(Xd, Yp, Zb)`` or ``((Y1p, Z1b), (Y2p, Z2b))``;
        cohort batching appends the running bound, e.g. ``((1p, 4b), (1p, 4b), 64r)``."""
        b = self.microbatch
        running = f", {self.max_running}r" if self.cohorts else ""
        if self.budgeted:
            running = f", {self.max_running}r, {self.token_budget}t"
        if self.policy is Policy.DEJAVU:
            return f"(({self.depth}p, {b}b), ({self.token_depth}p, {b}b){running})"
        if self.replicas > 1:
            return f"({self.replicas}d, {self.depth}p, {b}b)"
        return f"({self.depth}p, {b}b{running})"

    def label(self) -> str:
        """A short name for plots and tables, e.g. ``DejaVu-2-4``."""
        suffix = (
            ("+swap" if self.swap else "") + ("+cohorts" if self.cohorts else "") + ("+budget" if self.budgeted else "")
        )
        if self.policy is Policy.DEJAVU:
            return f"DejaVu-{self.depth}-{self.token_depth}{suffix}"
        name = "FT" if self.policy is Policy.FASTER_TRANSFORMER else "Baseline"
        dp = f"x{self.replicas}" if self.replicas > 1 else ""
        return f"{name}-{self.depth}{dp}{suffix}"
