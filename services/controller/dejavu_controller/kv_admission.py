"""Microbatch size from a device KV budget (the paper's admission with and without swapping).

When ``swap.device_kv_budget_bytes`` is set, the token microbatch size is the largest the budget
allows for the deepest-loaded token stage: D_t caches on the device without swapping, two (one when
D_t <= 2) with it — so swapping admits the larger microbatch. A budget that fits not even one
sequence is a configuration error, reported with the numbers.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from dejavu_common.kv_budget import max_microbatch_size
from dejavu_common.settings import Settings

log = logging.getLogger("dejavu.controller.admission")

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(folder: Path, layers: int, dtype: str) -> int:
    """K and V bytes of one position of one sequence across ``layers`` layers of the checkpoint."""
    c = json.loads((folder / "config.json").read_text())
    heads = c.get("num_attention_heads") or c.get("n_head")
    kv_heads = c.get("num_key_value_heads") or heads
    hidden = c.get("hidden_size") or c.get("n_embd")
    head_dim = c.get("head_dim") or hidden // heads
    return 2 * layers * kv_heads * head_dim * _ITEMSIZE[dtype]


def admitted_microbatch(settings: Settings, n_layers: int) -> int:
    """The token microbatch size to use; raises ``KVBudgetError`` if the budget fits nothing."""
    budget = settings.swap.device_kv_budget_bytes
    c = settings.controller
    if budget is None:
        return c.token_microbatch
    layers = math.ceil(n_layers / c.token_depth)  # the first stages take the remainder
    per_token = kv_bytes_per_token(settings.model.folder, layers, settings.model.dtype)
    b = max_microbatch_size(budget, per_token, settings.engine.max_context, c.token_depth, settings.swap.enabled)
    log.info(
        "device KV budget %.1f MB, %d B per token per stage, context %d, D_t %d, swapping %s: microbatch %d",
        budget / 1e6,
        per_token,
        settings.engine.max_context,
        c.token_depth,
        settings.swap.enabled,
        b,
    )
    return b
