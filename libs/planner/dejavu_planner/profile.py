"""A model-on-hardware profile: what the planner and the simulator know about one setup.

A profile is a JSON file (format version 1, see docs/planner.md). It is measured by
``dejavu profile`` on the real engine, or written by hand for hardware we do not have (the
shipped ``profiles/*.json``). Times are seconds, sizes bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dejavu_planner.table import Curve, Grid

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Profile:
    """Costs of one model on one kind of machine.

    ``prompt_time(b, p)`` and ``token_time(b)`` are the time of ONE stage of a pipeline of
    ``measured_depth`` stages (the paper's ``Y`` and ``t`` at ``D = measured_depth``): one
    prompt of a microbatch of ``b`` requests padded to ``p`` tokens, and one token step of it.
    ``stream_overhead`` is the paper's ``m``: how much slower prompts run while their KV cache
    is streamed to the token machines. ``host_device_bytes_per_s`` is the swap bandwidth (PCIe
    on a GPU machine); ``None`` when unknown, which rules swapping out.

    ``head_time(b)``, when given, is what the LAST stage of any pipeline spends after its layers
    on one step of a microbatch of ``b`` (final norm, LM head on the last position, sampling);
    ``prompt_time`` and ``token_time`` then exclude it. Without it the head is folded into the
    per-layer times, as the paper's equations do. For a small model the head is worth a few
    layers (SmolLM2-135M: its 49k-word head costs about as much as 5 of its 30 layers), so a
    pipeline's last stage is its slowest. ``co_runners`` records how many other processes loaded
    the same host while it was measured (0: a machine of its own).

    ``member_time`` is what one token step of the serving runtime's cohorts costs per microbatch
    beyond the first (at ``measured_depth``, the head excluded): a cohort batches its members' rows
    through the projections and MLPs once, but each member attends over its own cache in a call of
    its own. 0 (the default, and the paper's model) when unknown.
    """

    model: str
    hardware: str
    layers: int
    weight_bytes_per_layer: int
    kv_bytes_per_token_per_layer: int
    machine_memory_bytes: int
    measured_depth: int
    prompt_time: Grid
    token_time: Curve
    stream_overhead: float = 1.0
    host_device_bytes_per_s: float | None = None
    head_time: Curve | None = None
    co_runners: int = 0
    member_time: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "weight_bytes_per_layer", "kv_bytes_per_token_per_layer", "machine_memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Profile.{name} must be positive")
        if not 1 <= self.measured_depth <= self.layers:
            raise ValueError("Profile.measured_depth must be in [1, layers]")
        if self.stream_overhead <= 0:
            raise ValueError("Profile.stream_overhead (m) must be positive")
        if self.host_device_bytes_per_s is not None and self.host_device_bytes_per_s <= 0:
            raise ValueError("Profile.host_device_bytes_per_s must be positive or null")
        if self.co_runners < 0:
            raise ValueError("Profile.co_runners must be >= 0")
        if self.member_time < 0:
            raise ValueError("Profile.member_time must be >= 0")

    def prompt_layer_time(self, batch: int, prompt_len: int) -> float:
        """Seconds one layer spends on one prompt microbatch."""
        return self.prompt_time(batch, prompt_len) * self.measured_depth / self.layers

    def token_layer_time(self, batch: int) -> float:
        """Seconds one layer spends on one token step of a microbatch."""
        return self.token_time(batch) * self.measured_depth / self.layers

    def member_layer_time(self) -> float:
        """Seconds one layer spends per cohort member beyond the first on one token step."""
        return self.member_time * self.measured_depth / self.layers

    def head_step_time(self, batch: int) -> float:
        """Seconds the last stage spends after its layers on one step of ``batch`` rows (0 if folded in)."""
        return 0.0 if self.head_time is None else self.head_time(batch)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "layers": self.layers,
            "weight_bytes_per_layer": self.weight_bytes_per_layer,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "machine_memory_bytes": self.machine_memory_bytes,
            "measured_depth": self.measured_depth,
            "prompt_time_s": {
                "batch": list(self.prompt_time.x),
                "prompt_len": list(self.prompt_time.y),
                "values": [list(row) for row in self.prompt_time.values],
            },
            "token_time_s": {"batch": list(self.token_time.x), "values": list(self.token_time.values)},
            "stream_overhead": self.stream_overhead,
            "host_device_bytes_per_s": self.host_device_bytes_per_s,
            "head_time_s": None
            if self.head_time is None
            else {"batch": list(self.head_time.x), "values": list(self.head_time.values)},
            "co_runners": self.co_runners,
            "member_time_s": self.member_time,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """Parse a profile; raises ``ValueError`` on a wrong version or a missing/invalid field."""
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported profile format_version {version!r} (expected {FORMAT_VERSION})")
        try:
            prompt, token = data["prompt_time_s"], data["token_time_s"]
            bandwidth = data.get("host_device_bytes_per_s")
            head = data.get("head_time_s")
            return cls(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                layers=int(data["layers"]),
                weight_bytes_per_layer=int(data["weight_bytes_per_layer"]),
                kv_bytes_per_token_per_layer=int(data["kv_bytes_per_token_per_layer"]),
                machine_memory_bytes=int(data["machine_memory_bytes"]),
                measured_depth=int(data["measured_depth"]),
                prompt_time=Grid.from_json(
                    {"x": prompt["batch"], "y": prompt["prompt_len"], "values": prompt["values"]}
                ),
                token_time=Curve.from_json({"x": token["batch"], "values": token["values"]}),
                stream_overhead=float(data.get("stream_overhead", 1.0)),
                host_device_bytes_per_s=None if bandwidth is None else float(bandwidth),
                head_time=None if head is None else Curve.from_json({"x": head["batch"], "values": head["values"]}),
                co_runners=int(data.get("co_runners", 0)),
                member_time=float(data.get("member_time_s", 0.0)),
                source=str(data.get("source", "")),
            )
        except KeyError as exc:
            raise ValueError(f"profile is missing field {exc.args[0]!r}") from exc

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Read a profile file, or a shipped one by name (see :func:`builtin_profiles`)."""
        if not path.exists() and str(path) in builtin_profiles():
            path = Path(str(resources.files("dejavu_planner") / "profiles" / f"{path}.json"))
        return cls.from_json(json.loads(path.read_text()))


def builtin_profiles() -> list[str]:
    """Names of the hand-written profiles shipped with the package."""
    folder = resources.files("dejavu_planner") / "profiles"
    return sorted(entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json"))
