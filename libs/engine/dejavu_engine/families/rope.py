"""Rotary position embeddings of the rotary families: the unscaled one and the scaled variants of
transformers' ``rope_type`` (``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``).

Each variant's inverse frequencies are computed op for op as transformers computes them
(``transformers.modeling_rope_utils``), and a position's ``(cos, sin)`` as its rotary embedding module
does (``position * inv_freq``, both halves, ``cos``/``sin`` times the attention scaling, rounded to the
dtype), so the tables are transformers' numbers bit for bit.

``dynamic`` and ``longrope`` depend on the length of the sequence: transformers recomputes the frequencies
from ``max(position_ids) + 1`` of each forward call. Here that length is a row's own one: the positions it
fills in the call end at ``cur_len - pad`` (a prompt's length in its prefill, ``p + 1`` in the decode step
of position ``p``), so each row is rotated as transformers rotates that sequence when it generates it alone.
Every other variant has fixed frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dejavu_engine.geometry import BatchGeometry

KINDS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# The first table covers this many positions (or the checkpoint's limit, if smaller), and doubles on demand:
# a Llama 3.x table of all 131072 positions would take 128 MB per dtype.
_FIRST_TABLE = 4096


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a config.json: ``rope_parameters`` (transformers 5), else ``rope_scaling`` with
    the top-level ``rope_theta`` (older checkpoints); ``{}`` when it has neither."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a mapping, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rotary parameters per layer type ({', '.join(params)}) are not supported")
    return dict(params)


class Rotary:
    """A checkpoint's rotary embedding: its kind, inverse frequencies and attention scaling, and per-call
    ``(cos, sin)`` rows (the sign of ``rotate_half`` in ``sin``).

    ``aliases`` renames a family's own rope types (Phi-3 calls ``longrope`` ``su`` and ``yarn``);
    ``original_max`` is the family's default pretraining length for the variants that use one, where a
    config names none (transformers falls back to ``max_position_embeddings`` except for Phi-3).
    Raises ValueError for a variant or option it does not implement.
    """

    def __init__(
        self,
        config: dict[str, Any],
        head_dim: int,
        aliases: dict[str, str] | None = None,
        original_max: int | None = None,
    ) -> None:
        params = rope_parameters(config)
        kind = str(params.get("rope_type", params.get("type", "default")))
        self.kind = (aliases or {}).get(kind, kind)
        if self.kind not in KINDS:
            raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(KINDS)})")
        partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ValueError(f"a partial rotary embedding (partial_rotary_factor {partial}) is not supported")
        self.params = params
        self.dim = head_dim
        self.theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        self.max_positions = int(config.get("max_position_embeddings", 2048))
        top_level = config.get("original_max_position_embeddings")
        self.original_max = int(
            top_level or params.get("original_max_position_embeddings") or original_max or self.max_positions
        )
        try:
            self.inv_freq, self.scaling = self._frequencies()
            self._long_inv_freq = self._longrope(long=True)[0] if self.kind == "longrope" else None
        except KeyError as exc:
            raise ValueError(f"rope type {self.kind!r} needs {exc.args[0]!r} in the rope parameters") from exc
        # (variant, device, dtype) -> (cos, sin) rows per position: built once, indexed per call.
        self._tables: dict[tuple[str, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- inverse frequencies, as transformers computes each variant -------------------------------------------

    def _exponents(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(0, self.dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / self.dim

    def _frequencies(self) -> tuple[torch.Tensor, float]:
        """The frequencies of a sequence within the pretraining length, and the attention scaling."""
        if self.kind == "yarn":
            return self._yarn()
        if self.kind == "longrope":
            return self._longrope(long=False)
        base = self.theta
        if self.kind == "dynamic":  # at init transformers takes max_position_embeddings as the length
            factor, limit = self.params["factor"], self.max_positions
            base = base * ((factor * limit / limit) - (factor - 1)) ** (self.dim / (self.dim - 2))
        inv_freq = 1.0 / (base ** self._exponents())
        if self.kind == "linear":
            inv_freq /= self.params["factor"]
        elif self.kind == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq, 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        factor = self.params["factor"]
        low_freq_factor = self.params["low_freq_factor"]
        high_freq_factor = self.params["high_freq_factor"]
        old_context_len = self.original_max
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)

    def _yarn(self) -> tuple[torch.Tensor, float]:
        params, dim, base = self.params, self.dim, self.theta
        factor = params.get("factor") or self.max_positions / self.original_max
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq, float(attention_factor)

    def _longrope(self, long: bool) -> tuple[torch.Tensor, float]:
        params = self.params
        factor = params.get("factor") or self.max_positions / self.original_max
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
        ext_factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext_factors.shape != (self.dim // 2,):
            raise ValueError(f"longrope factors must hold {self.dim // 2} numbers, got {tuple(ext_factors.shape)}")
        inv_freq = 1.0 / (ext_factors * self.theta ** self._exponents())
        return inv_freq, float(attention_factor)

    def _dynamic(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Dynamic NTK frequencies for a sequence of ``seq_len`` positions (past the pretraining length), in
        transformers' arithmetic: its length is a 0-dim int64 tensor, so the new base is computed in float32."""
        factor, limit = self.params["factor"], self.max_positions
        length = torch.maximum(
            torch.tensor(seq_len, dtype=torch.int64, device=device),
            torch.tensor(limit, dtype=torch.int64, device=device),
        )
        base = self.theta * ((factor * length / limit) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return 1.0 / (base ** self._exponents(device))

    def inv_freq_for(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """The frequencies of a sequence of ``seq_len`` positions where they differ from :attr:`inv_freq`
        (``dynamic`` past ``max_position_embeddings``, ``longrope`` past the pretraining length), else None."""
        if self.kind == "dynamic" and seq_len > self.max_positions:
            return self._dynamic(seq_len, device)
        if self.kind == "longrope" and seq_len > self.original_max:
            return self._long_inv_freq.to(device)  # type: ignore[union-attr]
        return None

    # -- cos / sin ---------------------------------------------------------------------------------------------

    def angles(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[..., head_dim]`` of integer ``positions`` for ``inv_freq``, as transformers' rotary
        module computes them; ``rotate_half``'s sign is in ``sin``, since ``rotate_half(x) * sin ==
        swap_halves(x) * (-sin, sin)``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.scaling
        sin = torch.cat((-freqs, freqs), dim=-1).sin() * self.scaling
        return cos.to(dtype), sin.to(dtype)

    def table(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[>= length, head_dim]`` of :attr:`inv_freq`, row p for position p (bit-identical to
        :meth:`angles` of those positions); grown by doubling when a call needs more."""
        return self._table("base", self.inv_freq, length, device, dtype)

    def _table(
        self, variant: str, inv_freq: torch.Tensor, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (variant, device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < length:
            size = max(length, min(self.max_positions, _FIRST_TABLE), 2 * table[0].shape[0] if table else 0)
            table = self._tables[key] = self.angles(torch.arange(size, device=device), inv_freq, dtype)
        return table

    def embed(
        self, geometry: BatchGeometry, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[batch, n, head_dim]`` of a call's ``positions`` ``[batch, n]``: each row with the
        frequencies of its own length (``cur_len - pad``)."""
        device = positions.device
        cos, sin = self.table(geometry.cur_len, device, dtype)
        cos, sin = cos[positions], sin[positions]
        if self.kind not in ("dynamic", "longrope"):
            return cos, sin
        for row, pad in enumerate(geometry.pad_lens):
            seq_len = geometry.cur_len - pad
            if self.kind == "longrope" and seq_len > self.original_max:
                long_cos, long_sin = self._table("long", self._long_inv_freq, seq_len, device, dtype)  # type: ignore[arg-type]
                cos[row], sin[row] = long_cos[positions[row]], long_sin[positions[row]]
            elif (inv_freq := self.inv_freq_for(seq_len, device)) is not None:
                cos[row], sin[row] = self.angles(positions[row], inv_freq, dtype)
        return cos, sin
