"""Scaling sweeps: the best simulated configuration of each policy for several machine counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dejavu_planner.planner import Planner
from dejavu_planner.trace import Trace


@dataclass(frozen=True)
class ScalingPoint:
    """The best configuration one policy found on ``machines`` machines, simulated over the trace."""

    machines: int
    policy: str
    configuration: str
    makespan_s: float
    cost: float  # machines × hours × price

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sweep(
    planner: Planner, trace: Trace, machine_counts: list[int], price: float = 1.0, swap: bool = False
) -> list[ScalingPoint]:
    """Plan every machine count with the trace (simulated makespans); one point per feasible policy."""
    points = []
    for machines in machine_counts:
        for policy in planner.plan(machines, swap=swap, trace=trace).policies:
            best = policy.best
            if best is None or best.makespan_s is None:
                continue
            cost = machines * best.makespan_s / 3600.0 * price
            points.append(ScalingPoint(machines, policy.name, best.deployment.notation(), best.makespan_s, cost))
    return points
