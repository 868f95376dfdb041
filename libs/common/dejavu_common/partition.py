"""How a model's layers are split into pipeline stages: one rule for the controller, engine and planner."""

from __future__ import annotations


def split_layers(n_layers: int, depth: int) -> list[tuple[int, int]]:
    """Contiguous global layer ranges [a, b) of ``depth`` stages, as even as possible, earlier stages
    taking the remainder. Raises ValueError unless 1 <= depth <= n_layers."""
    if not 1 <= depth <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {depth} stages (need 1 <= depth <= {n_layers})")
    base, extra = divmod(n_layers, depth)
    ranges, a = [], 0
    for stage in range(depth):
        b = a + base + (1 if stage < extra else 0)
        ranges.append((a, b))
        a = b
    return ranges
