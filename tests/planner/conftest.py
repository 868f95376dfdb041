"""A toy profile whose stage times are easy to compute by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dejavu_planner.profile import Profile
from dejavu_planner.table import Curve, Grid


def toy_profile(
    layers: int = 2,
    prompt_layer_s: float = 1.5,
    token_layer_s: float = 0.5,
    m: float = 1.0,
    memory: int = 10**12,
    weight_bytes: int = 1,
    kv_bytes: int = 1,
    bandwidth: float | None = None,
    head_s: float | None = None,
    member_s: float = 0.0,
) -> Profile:
    """Times independent of batch and prompt length: a stage of k layers takes k * per-layer time
    (plus ``head_s`` on a pipeline's last stage; ``member_s`` per cohort member beyond the first)."""
    return Profile(
        model="toy",
        hardware="toy",
        layers=layers,
        weight_bytes_per_layer=weight_bytes,
        kv_bytes_per_token_per_layer=kv_bytes,
        machine_memory_bytes=memory,
        measured_depth=1,
        prompt_time=Grid((1.0,), (1.0,), ((prompt_layer_s * layers,),)),
        token_time=Curve((1.0,), (token_layer_s * layers,)),
        stream_overhead=m,
        host_device_bytes_per_s=bandwidth,
        head_time=None if head_s is None else Curve((1.0,), (head_s,)),
        member_time=member_s,
        source="unit test",
    )


@pytest.fixture
def make_profile() -> Callable[..., Profile]:
    return toy_profile
