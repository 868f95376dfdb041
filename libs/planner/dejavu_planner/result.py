"""What a simulation reports: makespan, throughput, cost, per-request latency and a timeline."""

from __future__ import annotations

from dataclasses import dataclass

from dejavu_planner.deployment import Deployment


@dataclass(frozen=True)
class RequestRecord:
    """When one request arrived, got its first token and finished (seconds from the trace start)."""

    rid: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    new_tokens: int

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def normalized_latency_s(self) -> float:
        """End-to-end latency per generated token (the paper's "normalized latency")."""
        return self.latency_s / self.new_tokens


@dataclass(frozen=True)
class Segment:
    """One stage busy with one microbatch: ``step`` 0 is its prompt, ``k >= 1`` its k-th token step;
    ``rows`` the sequences computed. With cohort batching a token pass is one segment whose
    ``microbatch`` is the cohort and ``step`` its pass number (0: a colocated prefill)."""

    pipeline: str
    stage: int
    start_s: float
    end_s: float
    microbatch: int
    step: int
    rows: int = 0


@dataclass(frozen=True)
class SimResult:
    """The outcome of simulating one deployment over one trace."""

    deployment: Deployment
    makespan_s: float
    requests: tuple[RequestRecord, ...]
    timeline: tuple[Segment, ...]

    @property
    def generated_tokens(self) -> int:
        return sum(r.new_tokens for r in self.requests)

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.makespan_s

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s

    def cost(self, price_per_machine_hour: float = 1.0) -> float:
        """Machines × hours × price; with the default price 1 it is machine-hours (the paper's normalized cost)."""
        return self.deployment.machines * self.makespan_s / 3600.0 * price_per_machine_hour

    def mean_latency_s(self) -> float:
        return sum(r.latency_s for r in self.requests) / len(self.requests)

    def mean_normalized_latency_s(self) -> float:
        return sum(r.normalized_latency_s for r in self.requests) / len(self.requests)
