"""The controller's microbatch size from a device KV budget, with and without swapping."""

from __future__ import annotations

import json

import pytest

from dejavu_common.kv_budget import KVBudgetError
from dejavu_common.settings import Settings
from dejavu_controller.kv_admission import admitted_microbatch, kv_bytes_per_token


@pytest.fixture
def folder(tmp_path):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _settings(folder, budget, swap, depth=4):
    return Settings(
        model={"path": folder},
        engine={"max_context": 1000},
        controller={"token_depth": depth, "token_microbatch": 3},
        swap={"enabled": swap, "device_kv_budget_bytes": budget},
    )


def test_bytes_per_token_of_a_gqa_checkpoint(folder) -> None:
    # SmolLM2: 3 KV heads of 64 dims, K and V, float32: 2 * 3 * 64 * 4 = 1536 B per layer.
    assert kv_bytes_per_token(folder, 8, "float32") == 8 * 1536


def test_swapping_doubles_the_admitted_microbatch(folder) -> None:
    per_token = 8 * 1536  # 30 layers over 4 stages: the first stages hold 8
    budget = 4 * 8 * per_token * 1000  # 4 microbatches of 8 sequences of 1000 positions
    plain = admitted_microbatch(_settings(folder, budget, swap=False), 30)
    swapped = admitted_microbatch(_settings(folder, budget, swap=True), 30)
    assert plain == 8
    assert swapped >= 2 * plain - 1  # the swap-out staging buffer costs a sliver


def test_no_budget_keeps_the_configured_size_and_a_tiny_budget_is_refused(folder) -> None:
    assert admitted_microbatch(_settings(folder, None, swap=False), 30) == 3
    with pytest.raises(KVBudgetError):
        admitted_microbatch(_settings(folder, 1000, swap=True), 30)
