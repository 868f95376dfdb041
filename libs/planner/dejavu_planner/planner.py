"""The resource planner: the best Baseline, Baseline-DP and DejaVu configuration for ``D`` machines.

Every candidate (pipeline depths, replicas, microbatch size) is first checked against machine
memory (``CostModel.fits``) and scored by the paper's formulas (``formulas``). With a trace,
the best few candidates of each policy are then re-ranked by simulated makespan, which also
captures early stops and the distribution of generated lengths that the formulas average away.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dejavu_planner import formulas
from dejavu_planner.costmodel import CostModel, StageRole
from dejavu_planner.deployment import Deployment, Policy
from dejavu_planner.profile import Profile
from dejavu_planner.simulator import simulate
from dejavu_planner.trace import Trace
from dejavu_planner.workload import Workload

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)
SIMULATED_PER_POLICY = 5  # analytic front-runners re-ranked by simulation when a trace is given


@dataclass(frozen=True)
class Candidate:
    """A feasible deployment with its predicted throughput (and simulated makespan, if any)."""

    deployment: Deployment
    inverse_throughput_s: float  # seconds per microbatch of one pipeline (formulas)
    requests_per_s: float  # all pipelines together (formulas)
    makespan_s: float | None = None  # over the trace, when one was simulated

    @property
    def score(self) -> float:
        """Lower is better: simulated makespan when known, else seconds per request."""
        return self.makespan_s if self.makespan_s is not None else 1.0 / self.requests_per_s


@dataclass(frozen=True)
class PolicyPlan:
    """The best candidate of one policy (``None`` when none fits) and why."""

    name: str
    best: Candidate | None
    explanation: str


@dataclass(frozen=True)
class Plan:
    machines: int
    workload: Workload
    policies: tuple[PolicyPlan, ...]

    def report(self) -> str:
        """A human-readable table plus the explanations."""
        w = self.workload
        lines = [
            f"{self.machines} machines; prompt {w.prompt_len} tokens, {w.mean_new_tokens:.1f} new tokens on average "
            f"(N = {w.token_steps:.1f} token steps), at most {w.max_new_tokens}",
            f"{'policy':<12} {'configuration':<28} {'req/s':>9} {'tok/s':>9} {'makespan':>10}",
        ]
        for p in self.policies:
            if p.best is None:
                lines.append(f"{p.name:<12} {'(none fits)':<28}")
                continue
            c = p.best
            makespan = f"{c.makespan_s:9.1f}s" if c.makespan_s is not None else "         -"
            tokens = c.requests_per_s * w.mean_new_tokens
            lines.append(
                f"{p.name:<12} {c.deployment.notation():<28} {c.requests_per_s:9.3f} {tokens:9.1f} {makespan:>10}"
            )
        lines.append("")
        lines.extend(f"{p.name}: {p.explanation}" for p in self.policies)
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


class Planner:
    """Searches configurations of one profiled model for one workload."""

    def __init__(
        self, profile: Profile, workload: Workload, microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES
    ) -> None:
        self.cost = CostModel(profile)
        self.workload = workload
        self.microbatches = microbatches
        self.m = profile.stream_overhead

    # -- feasibility and prediction --------------------------------------------------------------

    def fits(self, d: Deployment) -> bool:
        """Whether every stage of the deployment fits in one machine's memory."""
        w, c = self.workload, self.cost
        if d.policy is Policy.DEJAVU:
            return c.fits(StageRole.PROMPT, d.depth, d.microbatch, w.prompt_len, w.max_new_tokens) and c.fits(
                StageRole.TOKEN, d.token_depth, d.microbatch, w.prompt_len, w.max_new_tokens, d.swap
            )
        return c.fits(StageRole.TOKEN, d.depth, d.microbatch, w.prompt_len, w.max_new_tokens, d.swap)

    def predict(self, d: Deployment) -> Candidate:
        """Formula throughput of a deployment: Eq. (3) per baseline pipeline, ``max(I_t, I_p)`` for DejaVu."""
        w, N = self.workload, self.workload.token_steps
        D = d.machines if d.policy is Policy.DEJAVU else d.depth
        Y, t = self.cost.prompt_time_at(D, d.microbatch, w.prompt_len), self._t(D, d)
        if d.policy is Policy.DEJAVU:
            inverse = formulas.disaggregated_inverse_throughput(D, d.depth, d.token_depth, Y, t, N, self.m)
        else:
            inverse = formulas.baseline_inverse_throughput(D, Y, t, N)
        pipelines = 1 if d.policy is Policy.DEJAVU else d.replicas
        return Candidate(d, inverse, pipelines * d.microbatch / inverse)

    def _t(self, depth: int, d: Deployment) -> float:
        """``t`` at ``depth``; with swapping the mean of ``max(t, transfer)``, taken at the mean context."""
        if not d.swap:
            return self.cost.token_time_at(depth, d.microbatch)
        context = round(self.workload.prompt_len + self.workload.mean_new_tokens / 2)
        return self.cost.swapped_token_time_at(depth, d.microbatch, context)

    # -- search ------------------------------------------------------------------------------------

    def baseline(self, machines: int, swap: bool = False) -> list[Candidate]:
        """One pipeline over all machines, every microbatch size that fits."""
        return self._feasible(Deployment(Policy.BASELINE, machines, b, swap=swap) for b in self.microbatches)

    def baseline_dp(self, machines: int, swap: bool = False) -> list[Candidate]:
        """``d >= 2`` equal pipelines (``d`` divides the machines), every microbatch size."""
        return self._feasible(
            Deployment(Policy.BASELINE, machines // d, b, replicas=d, swap=swap)
            for d in range(2, machines + 1)
            if machines % d == 0
            for b in self.microbatches
        )

    def dejavu(self, machines: int, swap: bool = False) -> list[Candidate]:
        """Every split ``D_p + D_t = machines`` and microbatch size (same in both pipelines)."""
        return self._feasible(
            Deployment(Policy.DEJAVU, dp, b, token_depth=machines - dp, swap=swap)
            for dp in range(1, machines)
            for b in self.microbatches
        )

    def _feasible(self, deployments: Iterable[Deployment]) -> list[Candidate]:
        found = [self.predict(d) for d in deployments if self.fits(d)]
        return sorted(found, key=lambda c: (c.score, c.deployment.machines))

    def plan(self, machines: int, swap: bool = False, trace: Trace | None = None) -> Plan:
        """The best configuration of each policy on ``machines`` machines, with explanations."""
        if machines < 1:
            raise ValueError("machines must be >= 1")
        if swap and self.cost.profile.host_device_bytes_per_s is None:
            raise ValueError(f"profile {self.cost.profile.model!r} has no host_device_bytes_per_s: cannot swap")
        searches = (
            ("Baseline", self.baseline(machines, swap)),
            ("Baseline-DP", self.baseline_dp(machines, swap)),
            ("DejaVu", self.dejavu(machines, swap)),
        )
        policies = []
        for name, found in searches:
            if trace is not None and found:
                found = self._rerank(found[:SIMULATED_PER_POLICY], trace)
            best = found[0] if found else None
            policies.append(PolicyPlan(name, best, self._explain(name, machines, best, swap)))
        return Plan(machines, self.workload, tuple(policies))

    def _rerank(self, candidates: list[Candidate], trace: Trace) -> list[Candidate]:
        simulated = [
            Candidate(
                c.deployment,
                c.inverse_throughput_s,
                c.requests_per_s,
                simulate(c.deployment, trace, self.cost).makespan_s,
            )
            for c in candidates
        ]
        return sorted(simulated, key=lambda c: c.score)

    # -- explanations -----------------------------------------------------------------------------

    def _explain(self, name: str, machines: int, best: Candidate | None, swap: bool) -> str:
        if name != "Baseline" and machines < 2:
            return "needs at least 2 machines (two pipelines)."
        if best is None:
            return self.explain_infeasible(machines, swap)
        if name == "DejaVu":
            return self.explain_split(best)
        if name == "Baseline-DP":
            return self._explain_dp(best)
        return self._explain_microbatch(best)

    def _explain_microbatch(self, best: Candidate) -> str:
        d = best.deployment
        larger = [b for b in self.microbatches if b > d.microbatch]
        if not larger:
            return f"b={d.microbatch} is the largest microbatch tried and it fits memory."
        bigger = Deployment(d.policy, d.depth, larger[0], d.token_depth, d.replicas, d.swap)
        if not self.fits(bigger):
            return (
                f"memory binds: b={larger[0]} does not fit ({self._stage_need(bigger)} on the fullest stage "
                f"> {_gib(self.cost.profile.machine_memory_bytes)})."
            )
        return f"b={larger[0]} fits but predicts lower throughput (prompt time grows with b faster than it pays off)."

    def _explain_dp(self, best: Candidate) -> str:
        d = best.deployment
        return (
            f"{d.replicas} pipelines of depth {d.depth} each run Eq. (3) with fewer stages, so fewer "
            f"(D-1)(Y-t)/D bubbles; {self._explain_microbatch(best)}"
        )

    def explain_split(self, best: Candidate) -> str:
        """Why a DejaVu split was chosen: Y, t, the continuous optimum, which pipeline binds, Eq. (4)."""
        d, w = best.deployment, self.workload
        D, b, N = d.machines, d.microbatch, w.token_steps
        Y, t = self.cost.prompt_time_at(D, b, w.prompt_len), self._t(D, d)
        I_p = formulas.prompt_inverse_throughput(D, d.depth, Y, self.m)
        I_t = formulas.token_inverse_throughput(D, d.token_depth, t, N)
        optimum = formulas.optimal_token_depth(D, Y, t, N, self.m)
        threshold = formulas.benefit_threshold(D, self.m)
        bound = "token pipeline (I_t)" if I_t >= I_p else "prompt pipeline (I_p)"
        gain = (
            f"Eq. (4): Y/t = {Y / t:.1f} vs threshold {threshold:.2f}, "
            + (
                "disaggregation pays off."
                if formulas.disaggregation_beneficial(D, Y, t, self.m)
                else "no gain expected."
            )
            if threshold is not None
            else f"Eq. (4): m = {self.m} >= 2 - 1/D, no gain expected."
        )
        rounded = formulas.integer_split(D, Y, t, N, self.m)
        memory = ""
        if rounded is not None and rounded != (d.depth, d.token_depth):
            alternative = Deployment(Policy.DEJAVU, rounded[0], b, token_depth=rounded[1], swap=d.swap)
            why = "does not fit memory" if not self.fits(alternative) else "had a longer simulated makespan"
            memory = f" Eq. 5 rounded would be {rounded}, which {why}."
        return (
            f"Y = {Y:.3g}s, t = {t:.3g}s at D={D}, b={b}; continuous optimum D_t = {optimum:.2f} (Eq. 5), "
            f"chosen D_p={d.depth}, D_t={d.token_depth}: I_p = {I_p:.3g}s, I_t = {I_t:.3g}s per microbatch, "
            f"the {bound} binds.{memory} {gain}"
        )

    def explain_infeasible(self, machines: int, swap: bool) -> str:
        """Why nothing fits: the memory bounds of Eq. (1) and (2) at the smallest microbatch."""
        p, w = self.cost.profile, self.workload
        b = min(self.microbatches)
        C0 = self.cost.kv_per_layer(b, w.prompt_len)
        K0 = self.cost.kv_per_layer(b, w.max_new_tokens)
        W0, M, L = p.weight_bytes_per_layer, p.machine_memory_bytes, p.layers
        d_p = formulas.min_prompt_depth(L, C0, W0, M)
        d_t = formulas.min_token_depth(L, C0, K0, W0, M)
        token = "no depth fits (L(C0+K0) >= M)" if d_t is None else f"D_t >= {d_t:.2f}"
        prompt = "no depth fits" if d_p is None else f"D_p >= {d_p}"
        hint = "" if swap else " Try --swap."
        return f"nothing fits {machines} machines even at b={b}: Eq. (1) {prompt}, Eq. (2) {token}.{hint}"

    def _stage_need(self, d: Deployment) -> str:
        w = self.workload
        layers = -(-self.cost.layers // d.depth)
        resident = min(2, d.depth) if d.swap else d.depth
        need = self.cost.stage_memory(StageRole.TOKEN, layers, d.microbatch, w.prompt_len, w.max_new_tokens, resident)
        return _gib(need)


def split_workers(
    n_workers: int, profile: Profile, workload: Workload, microbatch: int = 1, swap: bool = False
) -> tuple[int, int, str]:
    """How many of ``n_workers`` should run prompts (``D_p``) and tokens (``D_t``), and why.

    Called by the controller for ``planner: auto``. Searches every split at the given
    microbatch size and returns the one the formulas predict fastest among those that fit
    memory. Raises ``ValueError`` when ``n_workers < 2`` or no split fits.
    """
    if n_workers < 2:
        raise ValueError("disaggregation needs at least 2 workers")
    planner = Planner(profile, workload, (microbatch,))
    found = planner.dejavu(n_workers, swap)
    if not found:
        raise ValueError(planner.explain_infeasible(n_workers, swap))
    best = found[0]
    return best.deployment.depth, best.deployment.token_depth, planner.explain_split(best)
