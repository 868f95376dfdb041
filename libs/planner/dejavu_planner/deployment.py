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


@dataclass(frozen=True)
class Deployment:
    """One configuration of machines.

    For the baselines ``depth`` is each pipeline's depth and ``replicas`` the number of
    pipelines; for DejaVu ``depth`` is the prompt pipeline's (``D_p``) and ``token_depth`` the
    token pipeline's (``D_t``). ``microbatch`` is the requests per microbatch in every
    pipeline; ``swap`` keeps in-flight token microbatches' KV in host memory.
    """

    policy: Policy
    depth: int
    microbatch: int
    token_depth: int = 0
    replicas: int = 1
    swap: bool = False

    def __post_init__(self) -> None:
        if self.depth < 1 or self.microbatch < 1 or self.replicas < 1:
            raise ValueError(f"invalid deployment {self}: depth, microbatch and replicas must be >= 1")
        if (self.policy is Policy.DEJAVU) != (self.token_depth >= 1):
            raise ValueError("token_depth >= 1 is required for, and only for, the dejavu policy")
        if self.policy is Policy.DEJAVU and self.replicas != 1:
            raise ValueError("dejavu deployments have one prompt and one token pipeline (replicas = 1)")

    @property
    def machines(self) -> int:
        if self.policy is Policy.DEJAVU:
            return self.depth + self.token_depth
        return self.depth * self.replicas

    def notation(self) -> str:
        """The paper's table notation: ``(Yp, Zb)``, ``(Xd, Yp, Zb)`` or ``((Y1p, Z1b), (Y2p, Z2b))``."""
        b = self.microbatch
        if self.policy is Policy.DEJAVU:
            return f"(({self.depth}p, {b}b), ({self.token_depth}p, {b}b))"
        if self.replicas > 1:
            return f"({self.replicas}d, {self.depth}p, {b}b)"
        return f"({self.depth}p, {b}b)"

    def label(self) -> str:
        """A short name for plots and tables, e.g. ``DejaVu-2-4``."""
        swap = "+swap" if self.swap else ""
        if self.policy is Policy.DEJAVU:
            return f"DejaVu-{self.depth}-{self.token_depth}{swap}"
        name = "FT" if self.policy is Policy.FASTER_TRANSFORMER else "Baseline"
        dp = f"x{self.replicas}" if self.replicas > 1 else ""
        return f"{name}-{self.depth}{dp}{swap}"
