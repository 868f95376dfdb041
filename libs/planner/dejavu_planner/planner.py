"""The resource planner: the best Baseline, Baseline-DP and DejaVu configuration for ``D`` machines.

Every candidate (pipeline depths, replicas, microbatch size) is first checked against machine
memory (``CostModel.fits``) and scored by the paper's formulas (``formulas``). With a trace,
the best few candidates of each policy are then re-ranked by simulated makespan, which also
captures early stops and the distribution of generated lengths that the formulas average away.

Next to the paper's policies the planner models the serving runtime's (cohort batching, see
:mod:`dejavu_planner.cohorts`): ``Planner.runtime`` and the plan's optional "DejaVu-runtime" row, and
:func:`split_workers`, which sizes the deployment ``dejavu up --planner auto`` starts; :func:`plan_runtime` also
sizes the token budget of its passes (:mod:`dejavu_planner.tokenbudget`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dejavu_planner import formulas
from dejavu_planner.costmodel import CostModel, StageRole
from dejavu_planner.deployment import DEFAULT_MAX_RUNNING, Batching, Deployment, Policy
from dejavu_planner.profile import Profile
from dejavu_planner.simulator import simulate
from dejavu_planner.tokenbudget import DEFAULT_ITL_TARGET_S, TokenBudget, size_token_budget
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
class CohortTimes:
    """The runtime's cohort policy in steady state (seconds): a full cohort's ``rows``, one pass of them
    on the slowest decoding stage, and the time per microbatch the token and prompt sides sustain."""

    rows: int
    pass_s: float
    token_s: float  # I_t
    prompt_s: float  # I_p

    @property
    def inverse_throughput_s(self) -> float:
        return max(self.token_s, self.prompt_s)


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
            f"{'policy':<14} {'configuration':<34} {'req/s':>9} {'tok/s':>9} {'makespan':>10}",
        ]
        for p in self.policies:
            if p.best is None:
                lines.append(f"{p.name:<14} {'(none fits)':<34}")
                continue
            c = p.best
            makespan = f"{c.makespan_s:9.1f}s" if c.makespan_s is not None else "         -"
            tokens = c.requests_per_s * w.mean_new_tokens
            lines.append(
                f"{p.name:<14} {c.deployment.notation():<34} {c.requests_per_s:9.3f} {tokens:9.1f} {makespan:>10}"
            )
        lines.append("")
        lines.extend(f"{p.name}: {p.explanation}" for p in self.policies)
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


class Planner:
    """Searches configurations of one profiled model for one workload; ``max_running`` is the serving
    runtime's bound on requests decoded at once (its cohort candidates only)."""

    def __init__(
        self,
        profile: Profile,
        workload: Workload,
        microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES,
        max_running: int = DEFAULT_MAX_RUNNING,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.cost = CostModel(profile)
        self.workload = workload
        self.microbatches = microbatches
        self.max_running = max_running
        self.m = profile.stream_overhead

    # -- feasibility and prediction --------------------------------------------------------------

    def fits(self, d: Deployment) -> bool:
        """Whether every stage of the deployment fits in one machine's memory.

        With cohorts (and no swapping) a token stage holds the KV of every dispatched request, each at
        worst at its prompt plus the longest generation; with swapping a cohort holds one microbatch,
        so the paper's model of preallocated microbatch caches applies.
        """
        w, c = self.workload, self.cost
        if d.cohorts and not d.swap:
            positions = w.prompt_len + w.max_new_tokens
            tokens = c.fits_rows(d.cohort_depth, self.dispatched_rows(d), positions)
            if d.policy is Policy.DEJAVU:
                return tokens and c.fits(StageRole.PROMPT, d.depth, d.microbatch, w.prompt_len, w.max_new_tokens)
            return tokens
        if d.policy is Policy.DEJAVU:
            return c.fits(StageRole.PROMPT, d.depth, d.microbatch, w.prompt_len, w.max_new_tokens) and c.fits(
                StageRole.TOKEN, d.token_depth, d.microbatch, w.prompt_len, w.max_new_tokens, d.swap
            )
        return c.fits(StageRole.TOKEN, d.depth, d.microbatch, w.prompt_len, w.max_new_tokens, d.swap)

    @staticmethod
    def dispatched_rows(d: Deployment) -> int:
        """The runtime controller's bound on dispatched, unfinished requests: ``max_running`` plus the
        prompt microbatches the prompt pipeline may run ahead (``D_p · b``)."""
        ahead = d.depth * d.microbatch if d.policy is Policy.DEJAVU else 0
        return d.max_running + ahead

    def predict(self, d: Deployment) -> Candidate:
        """Formula throughput of a deployment: Eq. (3) per baseline pipeline, ``max(I_t, I_p)`` for DejaVu;
        with cohorts, the runtime's forms (:meth:`cohort_times`)."""
        if d.cohorts:
            inverse = self.cohort_times(d).inverse_throughput_s
            return Candidate(d, inverse, d.microbatch / inverse)
        w, N = self.workload, self.workload.token_steps
        D = d.machines if d.policy is Policy.DEJAVU else d.depth
        Y, t = self.cost.prompt_time_at(D, d.microbatch, w.prompt_len), self._t(D, d)
        if d.policy is Policy.DEJAVU:
            inverse = formulas.disaggregated_inverse_throughput(D, d.depth, d.token_depth, Y, t, N, self.m)
        else:
            inverse = formulas.baseline_inverse_throughput(D, Y, t, N)
        pipelines = 1 if d.policy is Policy.DEJAVU else d.replicas
        return Candidate(d, inverse, pipelines * d.microbatch / inverse)

    def _t(self, depth: int, d: Deployment, rows: int | None = None) -> float:
        """``t`` at ``depth`` for ``rows`` (default: a microbatch); with swapping the mean of
        ``max(t, transfer)``, taken at the mean context."""
        rows = d.microbatch if rows is None else rows
        if not d.swap:
            return self.cost.token_time_at(depth, rows)
        context = round(self.workload.prompt_len + self.workload.mean_new_tokens / 2)
        return self.cost.swapped_token_time_at(depth, rows, context)

    def cohort_times(self, d: Deployment) -> CohortTimes:
        """A cohort deployment in steady state: ``R`` rows per full cohort (``R / b`` members), a pass of
        them on the slowest decoding stage ``t_R``, and the seconds per microbatch each side sustains.

        DejaVu: ``I_t = b N t_R / R``, ``I_p = m Y_b`` (the prompt pipeline's slowest stage). Colocated:
        the one pipeline does both, ``I_t = I_p = Y_b + b N t_R / R``. With swapping a cohort holds one
        microbatch (``R = b``).
        """
        w, b, N = self.workload, d.microbatch, self.workload.token_steps
        if d.swap:
            R, t_R = b, self._t(d.cohort_depth, d)
        else:
            R = formulas.cohort_rows(d.max_running, d.cohort_depth, b)
            t_R = self.cost.cohort_time_at(d.cohort_depth, R, R // b)
        Y_b = self.cost.prompt_time_at(d.depth, b, w.prompt_len)
        if d.policy is Policy.DEJAVU:
            return CohortTimes(R, t_R, formulas.cohort_token_inverse_throughput(b, R, t_R, N), self.m * Y_b)
        both = formulas.cohort_colocated_inverse_throughput(b, R, Y_b, t_R, N)
        return CohortTimes(R, t_R, both, both)

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

    def runtime(self, machines: int, swap: bool = False) -> list[Candidate]:
        """The serving runtime's DejaVu (cohort batching, ``max_running``): every split and microbatch size."""
        return self._feasible(
            Deployment(
                Policy.DEJAVU,
                dp,
                b,
                token_depth=machines - dp,
                swap=swap,
                batching=Batching.COHORT,
                max_running=self.max_running,
            )
            for dp in range(1, machines)
            for b in self.microbatches
        )

    def runtime_colocated(self, machines: int, swap: bool = False) -> list[Candidate]:
        """The serving runtime's colocated mode (one pipeline of ``machines`` stages doing prompts and
        tokens, cohort batching): every microbatch size that fits."""
        return self._feasible(
            Deployment(Policy.BASELINE, machines, b, swap=swap, batching=Batching.COHORT, max_running=self.max_running)
            for b in self.microbatches
        )

    def _feasible(self, deployments: Iterable[Deployment]) -> list[Candidate]:
        found = [self.predict(d) for d in deployments if self.fits(d)]
        return sorted(found, key=lambda c: (c.score, c.deployment.machines))

    def plan(self, machines: int, swap: bool = False, trace: Trace | None = None, runtime: bool = False) -> Plan:
        """The best configuration of each policy on ``machines`` machines, with explanations; with
        ``runtime`` also the serving runtime's DejaVu (cohort batching) as "DejaVu-runtime"."""
        if machines < 1:
            raise ValueError("machines must be >= 1")
        if swap and self.cost.profile.host_device_bytes_per_s is None:
            raise ValueError(f"profile {self.cost.profile.model!r} has no host_device_bytes_per_s: cannot swap")
        searches = (
            ("Baseline", self.baseline(machines, swap)),
            ("Baseline-DP", self.baseline_dp(machines, swap)),
            ("DejaVu", self.dejavu(machines, swap)),
        ) + ((("DejaVu-runtime", self.runtime(machines, swap)),) if runtime else ())
        policies = []
        for name, found in searches:
            if trace is not None and found:
                found = self.rerank(found[:SIMULATED_PER_POLICY], trace)
            best = found[0] if found else None
            policies.append(PolicyPlan(name, best, self._explain(name, machines, best, swap)))
        return Plan(machines, self.workload, tuple(policies))

    def rerank(self, candidates: list[Candidate], trace: Trace) -> list[Candidate]:
        """``candidates`` with their simulated makespans over ``trace``, best first."""
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
            return self.explain_infeasible(machines, swap, cohorts=name == "DejaVu-runtime")
        if name == "DejaVu-runtime":
            return self.explain_cohorts(best)
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

    def explain_cohorts(self, best: Candidate) -> str:
        """Why a runtime (cohort) deployment was chosen: rows per cohort, pass time, which side binds."""
        d = best.deployment
        times = self.cohort_times(d)
        R, t_R, I_t, I_p = times.rows, times.pass_s, times.token_s, times.prompt_s
        side = "token" if d.policy is Policy.DEJAVU else "colocated"
        head = (
            f"D_p={d.depth}, D_t={d.token_depth}: " if d.policy is Policy.DEJAVU else f"{d.depth} colocated stage(s): "
        )
        bound = "token pipeline (I_t)" if I_t >= I_p else "prompt pipeline (I_p)"
        return (
            f"{head}{d.cohort_depth} cohort(s) of up to {R} rows (max_running {d.max_running}, microbatches of "
            f"{d.microbatch}); a {side} pass of {R} rows takes {t_R:.3g}s on the slowest stage: "
            f"I_t = b·N·t/R = {I_t:.3g}s, I_p = {I_p:.3g}s per microbatch; the {bound} binds."
        )

    def explain_infeasible(self, machines: int, swap: bool, cohorts: bool = False) -> str:
        """Why nothing fits: the memory bounds of Eq. (1) and (2) at the smallest microbatch; with
        ``cohorts`` (no swapping) the KV of every request the runtime dispatches."""
        p, w = self.cost.profile, self.workload
        b = min(self.microbatches)
        if cohorts and not swap:
            rows = self.max_running + b
            return (
                f"nothing fits {machines} machines: a token stage holds the KV of up to {rows} dispatched requests "
                f"(max_running {self.max_running} plus a prompt microbatch) of {w.prompt_len + w.max_new_tokens} "
                f"positions besides its layers. Lower max_running, or add machines."
            )
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


@dataclass(frozen=True)
class RuntimePlan:
    """What ``dejavu up`` starts: colocated stages, or a prompt and a token pipeline, and why; and the token budget
    of its passes (``engine.token_budget``)."""

    colocated: bool
    prompt_depth: int  # 0 when colocated
    token_depth: int  # the colocated pipeline's depth when colocated
    why: str
    budget: TokenBudget


def plan_runtime(
    machines: int,
    profile: Profile,
    workload: Workload,
    microbatch: int = 1,
    swap: bool = False,
    max_running: int = DEFAULT_MAX_RUNNING,
    trace: Trace | None = None,
    itl_target_s: float = DEFAULT_ITL_TARGET_S,
    block_size: int = 16,
) -> RuntimePlan:
    """The serving runtime's deployment on ``machines`` machines: the predicted fastest of its colocated
    mode (one pipeline of every machine) and every disaggregated split (cohort batching in both), and the
    token budget of its passes for the inter-token latency target ``itl_target_s`` (:func:`size_token_budget`,
    KV blocks of ``block_size`` positions).

    One machine has nothing to split, so it runs colocated: on a single host the prompt and token
    workers of a split would only share the same cores. Raises ``ValueError`` when nothing fits.
    """
    if machines < 1:
        raise ValueError("machines must be >= 1")
    planner = Planner(profile, workload, (microbatch,), max_running)
    colocated = planner.runtime_colocated(machines, swap)
    split = planner.runtime(machines, swap) if machines >= 2 else []
    if trace is not None:
        colocated = planner.rerank(colocated[:SIMULATED_PER_POLICY], trace) if colocated else []
        split = planner.rerank(split[:SIMULATED_PER_POLICY], trace) if split else []
    found = sorted([*colocated[:1], *split[:1]], key=lambda c: c.score)
    if not found:
        raise ValueError(planner.explain_infeasible(machines, swap, cohorts=True))
    best = found[0]
    d = best.deployment
    why = planner.explain_cohorts(best)
    if machines == 1:
        why = f"one machine: nothing to disaggregate, prompts and tokens share it. {why}"
    elif len(found) == 2:
        other = found[1]
        why = (
            f"{why} Predicted {best.requests_per_s:.3g} req/s against {other.requests_per_s:.3g} for "
            f"{other.deployment.label()}."
        )
    disaggregated = d.policy is Policy.DEJAVU
    budget = size_token_budget(planner.cost, d.cohort_depth, max_running, itl_target_s, block_size, not disaggregated)
    if disaggregated:
        return RuntimePlan(False, d.depth, d.token_depth, why, budget)
    return RuntimePlan(True, 0, d.depth, why, budget)


def split_workers(
    n_workers: int,
    profile: Profile,
    workload: Workload,
    microbatch: int = 1,
    swap: bool = False,
    batching: Batching = Batching.COHORT,
    max_running: int = DEFAULT_MAX_RUNNING,
    trace: Trace | None = None,
) -> tuple[int, int, str]:
    """How many of ``n_workers`` should run prompts (``D_p``) and tokens (``D_t``), and why.

    Called for ``planner: auto`` (``dejavu up --planner auto``). Searches every split at the given
    microbatch size and returns the one predicted fastest among those that fit memory: by default
    under the serving runtime's policy (cohorts of up to ``ceil(max_running / D_t)`` rows), with
    ``batching=Batching.MICROBATCH`` under the paper's. With ``trace`` the best few are re-ranked by
    simulated makespan. Raises ``ValueError`` when ``n_workers < 2`` or no split fits.
    """
    if n_workers < 2:
        raise ValueError("disaggregation needs at least 2 workers")
    planner = Planner(profile, workload, (microbatch,), max_running)
    cohorts = batching is Batching.COHORT
    found = planner.runtime(n_workers, swap) if cohorts else planner.dejavu(n_workers, swap)
    if not found:
        raise ValueError(planner.explain_infeasible(n_workers, swap, cohorts))
    if trace is not None:
        found = planner.rerank(found[:SIMULATED_PER_POLICY], trace)
    best = found[0]
    why = planner.explain_cohorts(best) if cohorts else planner.explain_split(best)
    return best.deployment.depth, best.deployment.token_depth, why
