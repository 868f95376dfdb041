"""The small interface each model family implements, and the per-call forward context.

A family knows the checkpoint names of its weights (so a stage loads only its share), how to build
the per-call context (positions, masks, rotary tables) and the math of its embedding, its decoder
layer and its head. Weights reach the family as ``dict[role, Tensor]`` per part, where roles are
short family-defined names (``"q"``, ``"fc1"``, ...) mapped to checkpoint names by the family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dejavu_engine.geometry import BatchGeometry

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a checkpoint that stages, caches and callers need."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    tie_word_embeddings: bool
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class SpecKeys:
    """Where a family's config.json keeps the facts of its :class:`ModelSpec`, and what a fact it lacks defaults to.

    Each key field names the config keys of one fact in the order they are read (transformers' ``attribute_map``
    aliases, as GPT-2's ``n_embd`` for ``hidden_size``): the first one set (present, neither null nor 0) counts.
    ``num_kv_heads`` defaults to ``num_heads`` and ``head_dim`` to ``hidden_size // num_heads``; with no keys the
    family reads neither (plain multi-head attention whatever the config holds). ``max_positions`` defaults to
    ``max_positions_default`` where that is set; any other fact the config lacks is refused by name.
    ``tie_word_embeddings`` is the config's own flag, else ``tied_default``.
    """

    num_layers: tuple[str, ...] = ("num_hidden_layers",)
    hidden_size: tuple[str, ...] = ("hidden_size",)
    num_heads: tuple[str, ...] = ("num_attention_heads",)
    num_kv_heads: tuple[str, ...] = ("num_key_value_heads",)
    head_dim: tuple[str, ...] = ("head_dim",)
    max_positions: tuple[str, ...] = ("max_position_embeddings",)
    max_positions_default: int | None = None
    tied_default: bool = True


def spec_from_config(model_type: str, config: dict[str, Any], keys: SpecKeys) -> ModelSpec:
    """The :class:`ModelSpec` of a config.json whose facts stand where ``keys`` says; raises ValueError naming a fact
    the config lacks or holds as something other than a positive whole number."""

    def read(fact: str, names: tuple[str, ...], default: int | None = None) -> int:
        value = next((config[name] for name in names if config.get(name)), default)
        if value is None:
            raise ValueError(f"{model_type}: config.json has no {fact} ({' or '.join(names)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{model_type}: config.json's {fact} is {value!r}, not a positive whole number")
        return value

    hidden = read("hidden size", keys.hidden_size)
    heads = read("attention head count", keys.num_heads)
    return ModelSpec(
        model_type=model_type,
        num_layers=read("layer count", keys.num_layers),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=read("key/value head count", keys.num_kv_heads, heads),
        head_dim=read("head size", keys.head_dim, hidden // heads),
        vocab_size=read("vocabulary size", ("vocab_size",)),
        max_positions=read("position count", keys.max_positions, keys.max_positions_default),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", keys.tied_default)),
        eos_token_ids=eos_ids(config),
    )


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward call shares; built once per call by :meth:`Family.context`.

    ``start`` is the first cache position written (``cur_len - n``). ``mask`` is None (no masking,
    or plain causal when ``causal``), a bool tensor ``[batch, 1, n, cur_len]`` (True = attend) or an
    additive float tensor ``[batch, heads, n, cur_len]``. ``positions`` ``[batch, n]`` are per-row
    token positions (index minus the row's left padding). ``rope`` holds ``(cos, sin)`` for rotary
    families.

    ``groups`` is set when one call batches several microbatches, each with its own cache and
    geometry (iteration-level batching in the token stages): rows ``[a, b)`` belong to group ``g``
    and attend in that group's cache with that group's context ``(a, b, ctx_g)``. ``positions`` and
    ``rope`` then cover every row (what the projections need); ``geometry``, ``start``, ``mask`` and
    ``causal`` are group 0's, and attention never reads them.

    ``spans`` (int64 ``[batch, 4]``, one-token calls only) is set when the stage runs attention in the
    native kernel (:mod:`dejavu_engine.native`): row ``r`` attends positions ``[start, end)`` of row
    ``index`` of group ``group``'s cache, all rows of every group in one call.

    ``tables`` (int64 ``[batch, blocks]``) is set with ``spans`` (then int64 ``[batch, 2]``: ``start, end``)
    when the call's caches are blocks of one paged pool (:mod:`dejavulib.paged`): row ``r``'s logical
    block ``i`` is pool block ``tables[r, i]``, and the layer's caches are the pool's slabs of that layer.

    ``segments`` is set for a *ragged* prefill (:meth:`Stage.forward` of whole left-padded prompts): the
    call's one row is every prompt's tokens back to back, without padding. Segment
    ``(offset, length, row, start, ctx_s)`` is tokens ``[offset, offset + length)``: cache row ``row``'s
    prompt, written at cache positions ``[start, start + length)``, attending only over itself with its own
    context ``ctx_s`` (causal; ALiBi biases). ``positions`` and ``rope`` cover every token. With ``places``
    (int64 ``[written, 3]``: offset, start, end, one per segment of a live row) the prompts' cache is a paged pool:
    the layer's caches are the pool's slabs of that layer, ``tables`` holds the block table of each written
    segment's row in the same order, and its keys and values go straight into those blocks at positions
    ``[start, end)`` (a finished row's segment is computed and written nowhere).

    ``mixed`` is set for a pass that decodes some rows and prefills whole prompts at once (a colocated
    one-stage pipeline, :meth:`Stage.mixed`): ``(decode, prefill)``, the contexts of its first tokens (one per
    decoding row, paged: ``spans``/``tables``) and of the rest (every prompt's tokens back to back:
    ``segments``, with ``places``). ``positions`` and ``rope`` cover every token in that order; the layer's caches
    are then ``(pool slabs, pool slabs)`` pairs, one for each.

    ``native_prefill`` is set when the stage runs a prefill's attention in the native kernel
    (:func:`dejavu_engine.native.prefill_attention`): whole prompts, plainly causal (no mask, no biases),
    each row's (or each segment's) queries over its own new tokens only, all of them in one call.

    ``window_mask`` (bool ``[batch, 1, n, cur_len]``, True = attend) is set by a family with sliding-window layers
    on every context it builds (:meth:`Family.context`): ``mask``'s keys less those a window of
    ``Family.window`` positions drops (a query at ``i`` sees keys ``j`` with ``i - window < j <= i``).
    ``local_rope`` is the sliding-window layers' ``(cos, sin)`` where they differ from ``rope`` (Gemma 3's local
    base). ``local`` marks the context of one sliding-window layer (set per layer by the stage): its attention
    masks each row, group, segment or slice with its own context's ``window_mask`` instead of ``mask``, or, in the
    native decode kernels, attends ``window_spans`` (``spans`` whose start is no earlier than ``end - window``)
    instead of ``spans``. The native prefill kernels take no window: a stage with sliding-window layers prefills
    through torch.
    """

    geometry: BatchGeometry
    start: int
    positions: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    groups: tuple[tuple[int, int, ForwardContext], ...] | None = None
    spans: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    segments: tuple[tuple[int, int, int, int, ForwardContext], ...] | None = None
    native_prefill: bool = False
    mixed: tuple[ForwardContext, ForwardContext] | None = None
    places: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None
    window_spans: torch.Tensor | None = None
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    local: bool = False

    @property
    def cur_len(self) -> int:
        return self.geometry.cur_len

    @classmethod
    def ragged(cls, geometry: BatchGeometry, contexts: list[ForwardContext]) -> ForwardContext:
        """One context for a ragged prefill of ``geometry``'s rows (whole prompts, left padded in the
        cache): ``contexts[r]`` is row ``r``'s own context, as if its prompt were alone and unpadded."""
        segments, offset = [], 0
        for row, (pad, ctx) in enumerate(zip(geometry.pad_lens, contexts, strict=True)):
            length = geometry.cur_len - pad
            segments.append((offset, length, row, pad, ctx))
            offset += length
        rope = None
        if contexts[0].rope is not None:
            rope = tuple(torch.cat([c.rope[i] for c in contexts], dim=1) for i in range(2))  # type: ignore[index]
        positions = torch.cat([c.positions for c in contexts], dim=1)
        return cls(
            geometry,
            0,
            positions,
            None,
            False,
            rope,  # type: ignore[arg-type]
            segments=tuple(segments),
            local_rope=cat_local_rope(contexts, dim=1),
        )

    @classmethod
    def combined(cls, decode: ForwardContext, prefill: ForwardContext) -> ForwardContext:
        """One context for a pass of ``decode``'s rows (one token each) followed by ``prefill``'s tokens (a
        ragged prefill), all in one row of tokens."""
        rows = decode.positions.shape[0]
        positions = torch.cat([decode.positions.view(1, rows), prefill.positions], dim=1)
        rope = None
        if decode.rope is not None and prefill.rope is not None:
            rope = tuple(
                torch.cat([decode.rope[i].reshape(1, rows, *decode.rope[i].shape[2:]), prefill.rope[i]], dim=1)
                for i in range(2)
            )
        return cls(prefill.geometry, 0, positions, None, False, rope, mixed=(decode, prefill))  # type: ignore[arg-type]

    @classmethod
    def grouped(cls, contexts: list[ForwardContext]) -> ForwardContext:
        """One context for a call over several groups of rows, each with its own cache and context."""
        groups, row = [], 0
        for ctx in contexts:
            groups.append((row, row + ctx.geometry.batch, ctx))
            row += ctx.geometry.batch
        first = contexts[0]
        rope = None
        if first.rope is not None:
            rope = tuple(torch.cat([c.rope[i] for c in contexts]) for i in range(2))  # type: ignore[index]
        return cls(
            first.geometry,
            first.start,
            torch.cat([c.positions for c in contexts]),
            first.mask,
            first.causal,
            rope,  # type: ignore[arg-type]
            tuple(groups),
            local_rope=cat_local_rope(contexts, dim=0),
        )


def cat_local_rope(contexts: Sequence[ForwardContext], dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``local_rope`` of contexts joined along ``dim`` (as their ``rope``), None where they have none."""
    parts = [c.local_rope for c in contexts]
    if any(p is None for p in parts):
        return None
    cos = torch.cat([p[0] for p in parts if p is not None], dim=dim)
    sin = torch.cat([p[1] for p in parts if p is not None], dim=dim)
    return cos, sin


class Family(ABC):
    """One architecture (Llama, OPT, GPT-2, BLOOM): weight names and forward math.

    ``model_type`` is config.json's name of the architecture; ``spec_keys`` says where its config keeps the facts of
    its :class:`ModelSpec` (:meth:`read_spec`, one reading for every family).

    ``window`` is the sliding window (in positions) of the global layers ``windowed_layers``; their attention
    masks with the contexts' ``window_mask`` or attends ``window_spans`` (:class:`ForwardContext`).
    ``attention_softcap`` is a soft cap of the attention logits (``cap * tanh(logits / cap)``, Gemma 2): torch's
    attention only (:meth:`torch_attention`).

    ``gemm_roles`` (of a prepared layer) and ``head_gemm_roles`` name the weights the family uses only
    through :func:`dejavu_engine.gemm.linear` / ``residual_linear``: a stage may replace them by
    oneDNN-packed copies (:mod:`dejavu_engine.gemm`).
    """

    model_type: ClassVar[str]
    spec_keys: ClassVar[SpecKeys] = SpecKeys()
    gemm_roles: tuple[str, ...] = ()
    head_gemm_roles: tuple[str, ...] = ()
    window: int | None = None
    windowed_layers: frozenset[int] = frozenset()
    attention_softcap: float | None = None

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.spec = self.read_spec(config)
        # The native kernels (dejavu_engine.native), where the stage runs on them: a family may take its
        # pointwise ops from there (one pass instead of several torch ops); None: torch's ops.
        self.kernels: Any = None

    def torch_attention(self, layers: tuple[int, int]) -> bool:
        """Whether global layers ``[first, last)`` attend through torch only: the family soft-caps attention
        logits (what the native kernels do not compute)."""
        return self.attention_softcap is not None

    def windowed(self, layers: tuple[int, int]) -> bool:
        """Whether one of global layers ``[first, last)`` has a sliding window (then a stage of them prefills
        through torch: the native prefill kernels take no window)."""
        first, last = layers
        return any(first <= i < last for i in self.windowed_layers)

    @classmethod
    def read_spec(cls, config: dict[str, Any]) -> ModelSpec:
        """Shape facts from config.json, where :attr:`spec_keys` says; raises ValueError for an unsupported option
        (:meth:`check_config`) or a fact the config lacks."""
        cls.check_config(config)
        return spec_from_config(cls.model_type, config, cls.spec_keys)

    @classmethod  # noqa: B027 - a family may refuse no option
    def check_config(cls, config: dict[str, Any]) -> None:
        """Raises ValueError for an option of config.json the family does not implement (an activation, an
        attention variant); the base refuses none."""

    @abstractmethod
    def embedding_names(self) -> dict[str, str]:
        """Roles -> checkpoint names of the weights the first stage needs."""

    @abstractmethod
    def layer_names(self, layer: int) -> dict[str, str]:
        """Roles -> checkpoint names of global layer ``layer``."""

    @abstractmethod
    def head_names(self) -> dict[str, str]:
        """Roles -> checkpoint names of the final norm and LM head (role ``"lm_head"``); with tied
        embeddings the LM head role names the embedding matrix."""

    def prepare_layer(self, w: Weights) -> Weights:
        """Rearrange one layer's loaded weights for speed (e.g. fuse projections), in place.

        Each role of :meth:`layer_names` must stay in ``w`` and keep its shape and values (it may
        become a view into a fused tensor), so the stage's checkpoint-named weights remain exact
        (until the stage packs a ``gemm_roles`` weight: then its views keep only their shapes).
        The default keeps the weights as loaded.
        """
        return w

    @abstractmethod
    def context(self, geometry: BatchGeometry, n: int, device: torch.device, dtype: torch.dtype) -> ForwardContext:
        """The shared context of a call feeding ``n`` new tokens per row."""

    @abstractmethod
    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Token ids ``[batch, n]`` -> hidden states ``[batch, n, hidden]``."""

    @abstractmethod
    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """One decoder layer; writes this call's K/V into ``k_cache``/``v_cache`` (``[batch,
        kv_heads, max_len, head_dim]`` views of the layer) at ``[ctx.start, ctx.cur_len)``."""

    @abstractmethod
    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden ``[batch, n, hidden]`` -> logits ``[batch, n, vocab]``."""


def fuse(w: Weights, roles: tuple[str, ...], fused_role: str) -> None:
    """Concatenate ``w[roles]`` along dim 0 into ``w[fused_role]``; the parts become views of it.

    One matmul then replaces several, with no extra memory (the separate copies are released).
    """
    fused = torch.cat([w[role] for role in roles])
    for role, part in zip(roles, fused.split([w[role].shape[0] for role in roles]), strict=True):
        w[role] = part
    w[fused_role] = fused


def module_names(prefix: str, modules: dict[str, str], bias: bool = True) -> dict[str, str]:
    """Roles -> checkpoint names for modules with a ``weight`` (and a ``bias``, as role ``<role>_bias``)."""
    names = {}
    for role, module in modules.items():
        names[role] = f"{prefix}{module}.weight"
        if bias:
            names[f"{role}_bias"] = f"{prefix}{module}.bias"
    return names


def eos_ids(config: dict[str, Any]) -> frozenset[int]:
    """``eos_token_id`` of a config: int, list or missing."""
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(v for v in value or () if isinstance(v, int))
