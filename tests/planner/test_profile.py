"""Interpolation tables and the profile JSON format."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from dejavu_planner.costmodel import CostModel, StageRole, split_layers
from dejavu_planner.profile import Profile, builtin_profiles
from dejavu_planner.table import Curve, Grid


def test_curve_interpolates_and_extrapolates_linearly() -> None:
    c = Curve((1.0, 2.0, 4.0), (10.0, 20.0, 30.0))
    assert c(1) == 10 and c(4) == 30
    assert c(3) == pytest.approx(25)  # halfway between 20 and 30
    assert c(8) == pytest.approx(50)  # last segment's slope 5 per unit
    assert c(0) == pytest.approx(0)  # first segment's slope 10 per unit
    assert c(-5) == 0  # clamped
    assert Curve((3.0,), (7.0,))(100) == 7  # one point: constant


def test_grid_is_bilinear() -> None:
    g = Grid((1.0, 3.0), (100.0, 200.0), ((1.0, 2.0), (3.0, 4.0)))
    assert g(1, 100) == 1 and g(3, 200) == 4
    assert g(2, 150) == pytest.approx(2.5)  # mean of the four corners
    assert g(3, 300) == pytest.approx(5)  # extrapolated along prompt length


def test_tables_reject_bad_axes() -> None:
    with pytest.raises(ValueError):
        Curve((2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError):
        Grid((1.0,), (1.0, 2.0), ((1.0,),))


def test_profile_json_round_trip(tmp_path: Path, make_profile: Callable[..., Profile]) -> None:
    profile = make_profile(bandwidth=1e9, m=1.1)
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    with_head = make_profile(head_s=0.25)
    with_head.save(path)
    assert Profile.load(path) == with_head
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["format_version"] == 1
    data["format_version"] = 2
    with pytest.raises(ValueError, match="format_version"):
        Profile.from_json(data)
    del data["layers"]
    data["format_version"] = 1
    with pytest.raises(ValueError, match="layers"):
        Profile.from_json(data)


def test_shipped_opt66b_profile() -> None:
    assert "opt66b-2xa100-80gb" in builtin_profiles()
    p = Profile.load(Path("opt66b-2xa100-80gb"))
    assert p.layers == 64
    assert p.kv_bytes_per_token_per_layer == 2 * 9216 * 2  # K and V, hidden 9216, fp16
    # Prompt/token ratio at b=8, 1000 tokens lies in the paper's 1.4x-106x range.
    assert 1.4 < p.prompt_time(8, 1000) / p.token_time(8) < 106
    assert p.stream_overhead == pytest.approx(1.02)


def test_layers_split_evenly() -> None:
    assert split_layers(10, 4) == (3, 3, 2, 2)
    assert split_layers(4, 4) == (1, 1, 1, 1)
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_costmodel_times_and_memory(make_profile: Callable[..., Profile]) -> None:
    # 12 layers; per-layer prompt 1.5 s and token 0.5 s; W0 = 10 B, 2 B of KV per token per layer.
    cost = CostModel(make_profile(layers=12, weight_bytes=10, kv_bytes=2, memory=1000, bandwidth=4.0))
    assert cost.prompt_time_at(4, 1, 1) == pytest.approx(3 * 1.5)  # Y at D=4: 3 layers per stage
    assert cost.token_time_at(3, 1) == pytest.approx(4 * 0.5)
    assert cost.swap_in_time(3, 2, 10) == pytest.approx(3 * 2 * 10 * 2 / 4.0)
    # Token stage at depth 4: 3 layers * (10 B + 4 microbatches * 2 rows * (5+5) tokens * 2 B) = 510 B.
    assert cost.stage_memory(StageRole.TOKEN, 3, 2, 5, 5, resident=4) == 3 * 10 + 4 * 3 * 2 * 10 * 2
    # Prompt stage: 3 layers * (10 B + 2 rows * 5 tokens * 2 B) = 90 B.
    assert cost.stage_memory(StageRole.PROMPT, 3, 2, 5, 5, resident=1) == 90
    # Memory 500 B, b=2, contexts of 5+5 tokens: 40 B of KV per layer per microbatch.
    # Depth d puts ceil(12/d) layers on the fullest stage, which holds d microbatches (2 when swapping).
    small = CostModel(make_profile(layers=12, weight_bytes=10, kv_bytes=2, memory=500))
    assert not small.fits(StageRole.TOKEN, 4, 2, 5, 5)  # 3*10 + 4*3*40 = 510 > 500
    assert small.fits(StageRole.TOKEN, 4, 2, 5, 5, swap=True)  # 3*10 + 2*3*40 = 270
    assert small.fits(StageRole.TOKEN, 6, 2, 5, 5)  # 2*10 + 6*2*40 = 500
    assert not small.fits(StageRole.TOKEN, 5, 2, 5, 5)  # 3*10 + 5*3*40 = 630: uneven splits cost memory
    assert small.fits(StageRole.PROMPT, 1, 2, 5, 5)  # 12*(10 + 2*5*2) = 360
    assert not small.fits(StageRole.TOKEN, 13, 1, 5, 5)  # deeper than the model


def test_head_time_lands_on_the_last_stage(make_profile: Callable[..., Profile]) -> None:
    cost = CostModel(make_profile(layers=12, head_s=0.25))
    assert cost.token_stage_time(3, 1) == pytest.approx(1.5)
    assert cost.token_stage_time(3, 1, last=True) == pytest.approx(1.75)
    assert cost.prompt_stage_time(3, 1, 1, last=True) == pytest.approx(4.75)
    # The formulas' Y and t are the bottleneck (last) stage's.
    assert cost.prompt_time_at(4, 1, 1) == pytest.approx(4.5 + 0.25)
    assert cost.token_time_at(3, 1) == pytest.approx(2.0 + 0.25)
    # A profile measured without a separate head folds it into the layers (older profiles).
    legacy = json.loads(json.dumps(make_profile(layers=12).to_json()))
    del legacy["head_time_s"], legacy["co_runners"]
    assert CostModel(Profile.from_json(legacy)).token_time_at(3, 1) == pytest.approx(2.0)
