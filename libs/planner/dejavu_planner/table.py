"""Measured points and piecewise-linear interpolation between them.

A :class:`Curve` maps one variable (a microbatch size) to a time; a :class:`Grid` maps two (a
microbatch size and a prompt length). Between points both interpolate linearly; beyond the
ends they extrapolate along the nearest segment, so a prompt time measured at 1,000 tokens
extends linearly to 2,000 (prompt cost is close to linear in both batch and length, see the
paper's Appendix A). A single point is extrapolated as a constant. Results are clamped at 0.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any


def _check_axis(name: str, axis: tuple[float, ...]) -> None:
    if not axis:
        raise ValueError(f"{name} needs at least one point")
    if any(b <= a for a, b in itertools.pairwise(axis)):
        raise ValueError(f"{name} must be strictly increasing, got {axis}")


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)``, extended along the end segments (never below
    the nearest measurement above the range), clamped at 0."""
    if len(xs) == 1:
        return max(ys[0], 0.0)
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    # Beyond the measured range a noisy end segment may slope the wrong way: work never shrinks with
    # a larger batch or prompt, so extrapolation keeps at least the nearest measurement's value (above)
    # or its proportional share (below).
    if x > xs[-1]:
        y = max(y, ys[-1])
    elif x < xs[0] and xs[0] > 0:
        y = max(y, ys[0] * max(x, 0.0) / xs[0])
    return max(y, 0.0)


@dataclass(frozen=True)
class Curve:
    """Measured ``value(x)`` at increasing ``x`` points."""

    x: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_axis("Curve.x", self.x)
        if len(self.values) != len(self.x):
            raise ValueError("Curve.values must have one value per x")

    def __call__(self, x: float) -> float:
        return interpolate(self.x, self.values, x)

    def to_json(self) -> dict[str, Any]:
        return {"x": list(self.x), "values": list(self.values)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Curve:
        return cls(tuple(float(v) for v in data["x"]), tuple(float(v) for v in data["values"]))


@dataclass(frozen=True)
class Grid:
    """Measured ``value(x, y)`` on the grid ``x × y``; ``values[i][j]`` is at ``(x[i], y[j])``."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_axis("Grid.x", self.x)
        _check_axis("Grid.y", self.y)
        if len(self.values) != len(self.x) or any(len(row) != len(self.y) for row in self.values):
            raise ValueError("Grid.values must be a len(x) × len(y) table")

    def __call__(self, x: float, y: float) -> float:
        """Bilinear interpolation: first along ``y`` in every row, then along ``x``."""
        along_y = tuple(interpolate(self.y, row, y) for row in self.values)
        return interpolate(self.x, along_y, x)

    def to_json(self) -> dict[str, Any]:
        return {"x": list(self.x), "y": list(self.y), "values": [list(row) for row in self.values]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Grid:
        return cls(
            tuple(float(v) for v in data["x"]),
            tuple(float(v) for v in data["y"]),
            tuple(tuple(float(v) for v in row) for row in data["values"]),
        )
