"""K stages of one checkpoint in one process, run back to back (used by ``dejavu generate``)."""

from __future__ import annotations

from pathlib import Path

import torch

from dejavu_common.partition import split_layers
from dejavu_engine.families import family_for
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import LayerHook, Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.weights import load_config
from dejavulib.kvcache import KVCache


class Pipeline:
    """All layers of a checkpoint split into ``stages`` :class:`Stage` objects."""

    def __init__(
        self,
        folder: str | Path,
        stages: int = 1,
        device: str = "cpu",
        dtype: str = "float32",
        pack_gemms: bool = True,
        native_attention: bool = True,
        ragged_prefill: bool = True,
    ) -> None:
        num_layers = family_for(load_config(Path(folder))).spec.num_layers
        self.stages = [
            Stage(folder, bounds, device, dtype, pack_gemms, native_attention, ragged_prefill)
            for bounds in split_layers(num_layers, stages)
        ]
        self.spec = self.stages[0].spec

    def allocate(self, batch: int, max_len: int) -> list[KVCache]:
        """One cache per stage for a microbatch."""
        return [stage.allocate_cache(batch, max_len) for stage in self.stages]

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: list[KVCache],
        geometry: BatchGeometry,
        on_layer_done: LayerHook | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Token ids ``[batch, n]`` through every stage; returns logits (see :meth:`Stage.forward`)."""
        io = StageIO(input_ids=input_ids)
        for stage, cache in zip(self.stages, caches, strict=True):
            io = stage.forward(io, cache, geometry, on_layer_done, all_logits)
        assert io.logits is not None  # the last stage always returns logits
        return io.logits
