"""A pipeline stage: a contiguous range of global decoder layers of one checkpoint.

The first stage embeds token ids, the last applies the final norm and the LM head; a stage may be
both. A stage loads only its own weights (under their checkpoint names) and keeps no per-request
state: each microbatch brings its own :class:`KVCache` and :class:`BatchGeometry`, so one stage
serves many microbatches, one forward call at a time (not thread-safe).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dejavu_engine import gemm, grammar, native
from dejavu_engine.attention import decode_spans
from dejavu_engine.families import family_for
from dejavu_engine.family import ForwardContext, Weights
from dejavu_engine.geometry import BatchGeometry, Slice
from dejavu_engine.slices import context as pass_context
from dejavu_engine.stage_io import StageIO
from dejavu_engine.weights import CheckpointReader, load_config
from dejavulib.kvcache import KVCache, torch_dtype
from dejavulib.layout import KVLayout
from dejavulib.paged import BlockGeometry, BlockPool, PagedKVCache

AnyCache = KVCache | PagedKVCache

LayerHook = Callable[[int], None]


def _pack(w: Weights, roles: tuple[str, ...]) -> None:
    """Replace ``w[role]`` by its oneDNN-packed copy for each of ``roles``, in place. Views of a packed
    weight (the parts of a fused one) become meta tensors: they keep their shapes and dtypes, so the
    stage's accounting holds, but no longer hold the dense memory."""
    for role in roles:
        if role not in w:
            continue
        dense = w[role]
        w[role] = gemm.pack(dense)
        for other, t in w.items():
            if other != role and t._base is dense:
                w[other] = torch.empty(t.shape, dtype=t.dtype, device="meta")


class Stage:
    """Global layers ``[first, last)`` of the checkpoint in ``folder``.

    Raises :class:`~dejavu_engine.checkpoint.CheckpointError` for a missing folder or tensor and
    ValueError for an unsupported architecture or an empty / out-of-range layer range.
    """

    def __init__(
        self,
        folder: str | Path,
        layers: tuple[int, int],
        device: str = "cpu",
        dtype: str = "float32",
        pack_gemms: bool = True,
        native_attention: bool = True,
        ragged_prefill: bool = True,
    ) -> None:
        self.folder = Path(folder)
        self.family = family_for(load_config(self.folder))
        self.spec = self.family.spec
        first, last = layers
        if not 0 <= first < last <= self.spec.num_layers:
            raise ValueError(f"layer range {layers} not within [0, {self.spec.num_layers}) or empty")
        self.layers = (first, last)
        self.device = torch.device(device)
        self.dtype = dtype
        self.is_first = first == 0
        self.is_last = last == self.spec.num_layers
        if self.is_last:  # its logits' rows may be constrained by a grammar over this tokenizer
            grammar.register_vocabulary(self.folder, self.spec.vocab_size)
        # oneDNN-packed GEMM weights where this host can (CPU float32, and bfloat16 where oneDNN has
        # bfloat16 kernels for it): see dejavu_engine.gemm.
        self.packed_gemms = pack_gemms and gemm.can_pack(self.device, torch_dtype(dtype))
        # One-token attention of every row in one native call where the host can (CPU float32 or bfloat16,
        # and the kernels build): see dejavu_engine.native. Torch's attention per microbatch otherwise, and
        # for a family that soft-caps attention logits (Family.torch_attention).
        kernels_here = (
            native_attention and self.device.type == "cpu" and dtype in native.DTYPES and native.load() is not None
        )
        self.native_attention = kernels_here and not self.family.torch_attention(self.layers)
        # Which of this stage's layers attend within the family's sliding window (ForwardContext.local): the
        # native decode kernels attend the window's spans; the stage prefills through torch.
        self._local = [i in self.family.windowed_layers for i in range(first, last)]
        self.windowed = any(self._local)
        # The same kernels' pointwise ops (RMSNorm, SwiGLU) for the families that have them, where they are
        # vectorized (AVX-512 hosts; elsewhere torch's ops are faster).
        kernels = native.load() if kernels_here else None
        self.family.kernels = kernels if getattr(kernels, "POINTWISE_FAST", False) else None
        # Prefill of left-padded prompts computes their tokens only, back to back (ForwardContext.segments).
        self.ragged_prefill = ragged_prefill
        self.weights = self._load(CheckpointReader(self.folder))

    def _load(self, reader: CheckpointReader) -> dict[str, torch.Tensor]:
        """Load this stage's tensors and bind them to per-part role dictionaries."""
        parts: list[dict[str, str]] = [self.family.layer_names(i) for i in range(*self.layers)]
        embed_names = self.family.embedding_names() if self.is_first else {}
        head_names = self.family.head_names() if self.is_last else {}
        names = [*embed_names.values(), *head_names.values(), *(n for part in parts for n in part.values())]
        weights = reader.load(names, torch_dtype(self.dtype), self.device)
        self._embed_w: Weights = {role: weights[name] for role, name in embed_names.items()}
        self._head_w: Weights = {role: weights[name] for role, name in head_names.items()}
        self._layer_w: list[Weights] = []
        for part in parts:
            w = self.family.prepare_layer({role: weights[name] for role, name in part.items()})
            if self.packed_gemms:
                _pack(w, self.family.gemm_roles)
            weights.update((name, w[role]) for role, name in part.items())  # views into fused tensors
            self._layer_w.append(w)
        if self.packed_gemms:
            _pack(self._head_w, self.family.head_gemm_roles)
            for role, name in head_names.items():
                if name not in embed_names.values():  # a tied embedding stays dense for the lookup
                    weights[name] = self._head_w[role]
        return weights

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def param_bytes(self) -> int:
        """Bytes of the weights this stage holds (a tied matrix used twice counts once)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def kv_layout(self, batch: int, max_len: int) -> KVLayout:
        """Layout of this stage's cache for a microbatch of ``batch`` rows and ``max_len`` positions."""
        spec = self.spec
        return KVLayout(self.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim, self.dtype, self.layers[0])

    def allocate_cache(self, batch: int, max_len: int) -> KVCache:
        """A zeroed cache on this stage's device for one microbatch."""
        return KVCache.allocate(self.kv_layout(batch, max_len), self.device)

    def block_pool(self, block_size: int, max_blocks: int, slab_blocks: int = 64) -> BlockPool:
        """A paged KV pool of this stage's layers and heads on its device (see :mod:`dejavulib.paged`)."""
        return BlockPool(BlockGeometry.of(self.kv_layout(1, 1), block_size), max_blocks, slab_blocks, self.device)

    @functools.cached_property
    def paged_attention(self) -> bool:
        """Whether one-token calls over paged caches run in the native paged kernel: the kernel is built and
        the family's masks only select positions (no additive biases such as ALiBi). Otherwise a paged cache
        is computed on through a contiguous copy of its positions, which workers avoid (contiguous caches)."""
        if not (self.native_attention and hasattr(native.load(), "paged_decode_attention")):
            return False
        probe = self.family.context(BatchGeometry((1, 0), 2), 1, self.device, torch_dtype(self.dtype))
        return probe.mask is None or probe.mask.dtype == torch.bool

    @torch.inference_mode()
    def forward(
        self,
        io: StageIO,
        cache: KVCache,
        geometry: BatchGeometry,
        on_layer_done: LayerHook | None = None,
        all_logits: bool = False,
    ) -> StageIO:
        """Run this stage's layers for ``n`` new tokens per row, writing cache positions
        ``[geometry.cur_len - n, geometry.cur_len)`` of every layer in place.

        ``io`` carries ``input_ids`` into a first stage and ``hidden`` into the others. Returns
        ``hidden`` (``[batch, n, hidden]``) or, from a last stage, ``logits`` of the last position
        (``[batch, 1, vocab]``) or of all positions with ``all_logits``. ``on_layer_done(global_layer)``
        is called after each layer has written its KV.
        """
        x = self._input(io)
        if isinstance(cache, PagedKVCache):
            out = self._decode_paged(x, [(cache, geometry)]) if x.shape[1] == 1 and not all_logits else None
            if out is not None:
                return out
            if self.prefills_into_blocks and _whole_prompts(x, geometry, all_logits):
                return self._prefill_blocks(x, cache, geometry, on_layer_done)
            # Elsewhere (no paged kernels, a part of the prompts, all logits): compute on a contiguous copy, then
            # write the new positions back.
            n = geometry.cur_len if self._ragged(x, geometry, all_logits) else x.shape[1]
            cache.holding(geometry.cur_len)
            if n == geometry.cur_len:  # a whole prefill reads nothing it does not write: no copy in
                dense = KVCache.allocate(self.kv_layout(geometry.batch, geometry.cur_len), self.device)
            else:
                dense = cache.dense(geometry.cur_len)
            out = self.forward(io, dense, geometry, on_layer_done, all_logits)
            cache.write_back(dense, (geometry.cur_len - n, geometry.cur_len))
            return out
        if self._ragged(x, geometry, all_logits):
            return self._forward_ragged(x, cache, geometry, on_layer_done)
        batch, n = x.shape[0], x.shape[1]
        self._check(cache, geometry, batch, n)
        ctx = self.family.context(geometry, n, self.device, torch_dtype(self.dtype))
        if n == 1:
            ctx = self._natively(ctx, [ctx], [cache])
        elif self.native_attention and not self.windowed and ctx.mask is None and ctx.causal and geometry.rows is None:
            ctx = replace(ctx, native_prefill=True)  # whole unpadded prompts: the native prefill kernel
        hidden = self._layers(x, zip(cache.k, cache.v, strict=True), ctx, on_layer_done)
        if not self.is_last:
            return StageIO(hidden=hidden)
        return StageIO(logits=self.logits(hidden if all_logits else hidden[:, -1:]))

    def _layers(
        self,
        x: torch.Tensor,
        caches: Iterable[tuple[Any, Any]],
        ctx: ForwardContext,
        on_layer_done: LayerHook | None = None,
    ) -> torch.Tensor:
        """Embed (a first stage) and run every layer of this stage over ``x`` with ``ctx``, layer ``i`` over the
        ``i``-th ``(k, v)`` of ``caches``: a cache's layer, one per group of a grouped call, or a pool's slabs
        (:func:`_pool_layers`). A sliding-window layer runs with ``ctx`` marked ``local``."""
        hidden = self.family.embed(self._embed_w, x, ctx) if self.is_first else x
        local = replace(ctx, local=True) if any(self._local) else ctx
        for index, (w, (k_layer, v_layer)) in enumerate(zip(self._layer_w, caches, strict=True)):
            hidden = self.family.layer(w, hidden, k_layer, v_layer, local if self._local[index] else ctx)
            if on_layer_done is not None:
                on_layer_done(self.layers[0] + index)
        return hidden

    def _ragged(self, x: torch.Tensor, geometry: BatchGeometry, all_logits: bool) -> bool:
        """Whether this call is a ragged prefill: whole left-padded prompts (or their tokens already
        packed back to back by an earlier stage: one row of ``sum(lengths)`` tokens), all rows."""
        if geometry.batch == 1 or geometry.rows is not None or not geometry.padded:
            return False
        if x.shape[0] == 1:  # packed by the previous stage (a padded batch has geometry.batch > 1 rows)
            return x.shape[1] == geometry.batch * geometry.cur_len - sum(geometry.pad_lens)
        return self.ragged_prefill and not all_logits and x.shape[1] == geometry.cur_len

    def _forward_ragged(
        self, x: torch.Tensor, cache: KVCache, geometry: BatchGeometry, on_layer_done: LayerHook | None
    ) -> StageIO:
        """:meth:`forward` of a ragged prefill: every prompt's tokens back to back in one row (the padding
        is never computed), each written right-aligned into its own cache row. Returns hidden states in
        the same packed form (``[1, tokens, hidden]``, what the next stage takes) or, from a last stage,
        each row's last-position logits ``[batch, 1, vocab]``, as the padded path does."""
        if x.shape[0] != 1:
            x = _packed(x, geometry).unsqueeze(0)
        self._check(cache, geometry, geometry.batch, geometry.cur_len)
        hidden = self._layers(x, zip(cache.k, cache.v, strict=True), self._ragged_context(geometry), on_layer_done)
        if not self.is_last:
            return StageIO(hidden=hidden)
        return StageIO(logits=self.logits(hidden[0, _prompt_ends(geometry, hidden.device)].unsqueeze(1)))

    def _ragged_context(self, geometry: BatchGeometry) -> ForwardContext:
        """The context of a ragged prefill of ``geometry``'s whole prompts, each as if alone and unpadded; its
        attention in the native prefill kernel where every prompt is plainly causal (one call for all)."""
        dtype = torch_dtype(self.dtype)
        lengths = [geometry.cur_len - pad for pad in geometry.pad_lens]
        contexts = [self.family.context(BatchGeometry((0,), n), n, self.device, dtype) for n in lengths]
        ctx = ForwardContext.ragged(geometry, contexts)
        if self.native_attention and not self.windowed and all(c.mask is None for c in contexts):
            ctx = replace(ctx, native_prefill=True)
        return ctx

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's head (final norm and LM head) on ``hidden`` ``[batch, n, hidden]``: what a last
        stage does after its layers. The logits are float32 whatever the stage's dtype, as transformers'
        ``generate()`` takes them (exact: every bfloat16 is a float32), and torch's argmax over bfloat16
        rows is several times slower than the conversion. Raises ValueError on a stage that is not the last."""
        if not self.is_last:
            raise ValueError(f"stage {self.layers} is not the last stage: it holds no head")
        return self.family.head(self._head_w, hidden).float()

    def prefill(
        self,
        io: StageIO,
        cache: KVCache,
        geometry: BatchGeometry,
        on_layer_done: LayerHook | None = None,
        all_logits: bool = False,
    ) -> StageIO:
        """:meth:`forward` over whole (left-padded) prompts: positions ``[0, cur_len)`` (or, from a
        previous stage's ragged prefill, every prompt's tokens packed in one row)."""
        x = self._input(io)
        if x.shape[1] != geometry.cur_len and not (x.shape[0] == 1 and self._ragged(x, geometry, all_logits)):
            raise ValueError("prefill feeds all cur_len positions of the microbatch")
        return self.forward(io, cache, geometry, on_layer_done, all_logits)

    def decode(
        self, io: StageIO, cache: KVCache, geometry: BatchGeometry, on_layer_done: LayerHook | None = None
    ) -> StageIO:
        """:meth:`forward` of one token per row, written at position ``cur_len - 1``."""
        if self._input(io).shape[1] != 1:
            raise ValueError("decode feeds exactly one token per row")
        return self.forward(io, cache, geometry, on_layer_done)

    @torch.inference_mode()
    def decode_groups(self, io: StageIO, groups: list[tuple[KVCache, BatchGeometry]]) -> StageIO:
        """One decode step of several microbatches in one call (iteration-level batching).

        Group ``g`` brings its own cache and geometry; the rows of ``io`` are the groups' rows in
        order. The projections and MLPs run once over every row; each group attends over its own
        cache and length only. Equivalent to :meth:`decode` of each group alone.
        """
        if len(groups) == 1:
            return self.decode(io, *groups[0])
        x = self._input(io)
        if x.shape[1] != 1:
            raise ValueError("decode feeds exactly one token per row")
        if x.shape[0] != sum(g.batch for _, g in groups):
            raise ValueError(f"{x.shape[0]} rows for groups of {[g.batch for _, g in groups]} rows")
        paged = [isinstance(cache, PagedKVCache) for cache, _ in groups]
        if any(paged):
            if not all(paged) or len({cache.pool for cache, _ in groups}) != 1:  # type: ignore[union-attr]
                raise ValueError("one call's paged caches must all be blocks of one pool")
            out = self._decode_paged(x, groups)  # type: ignore[arg-type]
            if out is not None:
                return out
            dense = [(cache.holding(g.cur_len).dense(g.cur_len), g) for cache, g in groups]  # type: ignore[union-attr]
            out = self.decode_groups(io, dense)  # type: ignore[arg-type]
            for (cache, g), (copy, _) in zip(groups, dense, strict=True):
                cache.write_back(copy, (g.cur_len - 1, g.cur_len))  # type: ignore[union-attr]
            return out
        dtype = torch_dtype(self.dtype)
        contexts = []
        for cache, geometry in groups:
            self._check(cache, geometry, geometry.batch, 1)
            contexts.append(self.family.context(geometry, 1, self.device, dtype))
        ctx = self._natively(ForwardContext.grouped(contexts), contexts, [cache for cache, _ in groups])
        per_group = (([c.k[i] for c, _ in groups], [c.v[i] for c, _ in groups]) for i in range(self.num_layers))
        hidden = self._layers(x, per_group, ctx)
        if not self.is_last:
            return StageIO(hidden=hidden)
        return StageIO(logits=self.logits(hidden))

    def _decode_paged(self, x: torch.Tensor, groups: Sequence[tuple[PagedKVCache, BatchGeometry]]) -> StageIO | None:
        """One decode step of paged caches of one pool in one call of the paged kernel: every row writes
        its new K/V into its block and attends over its own span. None where the kernel does not apply
        (:attr:`paged_attention`)."""
        if not self.paged_attention:
            return None
        ctx = self._paged_context(groups)
        hidden = self._layers(x, _pool_layers(groups[0][0].pool, self.num_layers), ctx)
        if not self.is_last:
            return StageIO(hidden=hidden)
        return StageIO(logits=self.logits(hidden))

    def _paged_context(self, groups: Sequence[tuple[PagedKVCache, BatchGeometry]]) -> ForwardContext:
        """The context of one decode step of ``groups`` through the paged kernel (each row's span and block
        table, and in a stage with sliding-window layers their spans cut to the window); takes the blocks of the
        positions the step writes."""
        dtype = torch_dtype(self.dtype)
        contexts, tables = [], []
        spans: list[tuple[int, int]] = []
        for cache, geometry in groups:
            self._check(cache, geometry, geometry.batch, 1)
            contexts.append(self.family.context(geometry, 1, self.device, dtype))
            cache.holding(geometry.cur_len)  # the block of the position this step writes
            tables.append(cache.table[list(geometry.cache_rows)])
            spans.extend((pad, geometry.cur_len) for pad in geometry.pad_lens)
        width = max(t.shape[1] for t in tables)
        table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in tables])
        ctx = ForwardContext.grouped(contexts) if len(contexts) > 1 else contexts[0]
        window_spans = None
        if self.windowed:
            window = self.family.window
            assert window is not None
            window_spans = torch.tensor([(max(start, end - window), end) for start, end in spans], dtype=torch.long)
        return replace(ctx, spans=torch.tensor(spans, dtype=torch.long), tables=table, window_spans=window_spans)

    @functools.cached_property
    def prefills_into_blocks(self) -> bool:
        """Whether a prefill of whole prompts over a paged cache writes each layer's K/V straight into the
        pool's blocks (:meth:`_prefill_blocks`): the paged kernels apply, and the family's prompts are plainly
        causal (no mask, no biases, no sliding window), so the native prefill kernel computes their attention."""
        if self.windowed or not (self.paged_attention and hasattr(native.load(), "paged_write")):
            return False
        probe = self.family.context(BatchGeometry((0,), 2), 2, self.device, torch_dtype(self.dtype))
        return probe.mask is None and probe.causal

    def _prefill_blocks(
        self, x: torch.Tensor, cache: PagedKVCache, geometry: BatchGeometry, on_layer_done: LayerHook | None
    ) -> StageIO:
        """:meth:`forward` of whole prompts over a paged cache: a ragged prefill (every prompt's tokens back to
        back, the padding never computed) whose layers write their K/V straight into the cache's blocks, so no
        contiguous copy of the positions is made or written back. Returns what :meth:`_forward_ragged` returns
        (unpadded prompts' hidden states as ``[batch, cur_len, hidden]``, as the padded path gives them)."""
        self._check(cache, geometry, geometry.batch, geometry.cur_len)
        if x.shape[0] == geometry.batch and x.shape[1] == geometry.cur_len:
            x = _packed(x, geometry).unsqueeze(0)
        ctx = self._blocks_context(cache, geometry)
        hidden = self._layers(x, _pool_layers(cache.pool, self.num_layers), ctx, on_layer_done)
        if not self.is_last:
            return StageIO(hidden=hidden if geometry.padded else hidden.view(geometry.batch, geometry.cur_len, -1))
        return StageIO(logits=self.logits(hidden[0, _prompt_ends(geometry, hidden.device)].unsqueeze(1)))

    def _blocks_context(self, cache: PagedKVCache, geometry: BatchGeometry) -> ForwardContext:
        """The context of a ragged prefill of ``geometry``'s whole prompts into ``cache``'s blocks (each live
        row's block table and where its tokens go); takes the blocks of every live row's positions. A finished
        row holds no blocks: a recompute, which covers every row of its microbatch, computes its tokens and
        writes nothing of them."""
        cache.holding(geometry.cur_len)
        ctx = self._ragged_context(geometry)
        assert ctx.segments is not None and ctx.native_prefill  # prefills_into_blocks: plainly causal prompts
        kept = [(offset, length, row, start) for offset, length, row, start, _ in ctx.segments if cache.live[row]]
        places = torch.tensor([(offset, start, start + length) for offset, length, _, start in kept], dtype=torch.long)
        tables = cache.table[[row for _, _, row, _ in kept]]
        return replace(ctx, tables=tables, places=places.view(-1, 3))

    @functools.cached_property
    def mixes(self) -> bool:
        """Whether this stage runs mixed passes (:meth:`mixed`): it is the whole model (first and last), and
        both its decode (paged) and its prefill attention run in the native kernels, the prefill straight into
        the pool's blocks."""
        return self.is_first and self.is_last and self.prefills_into_blocks

    @torch.inference_mode()
    def mixed(
        self,
        io: StageIO,
        groups: list[tuple[PagedKVCache, BatchGeometry]],
        prefill: tuple[StageIO, PagedKVCache, BatchGeometry],
    ) -> StageIO:
        """One decode step of ``groups`` (as :meth:`decode_groups`: ``io`` holds one token per computed row)
        and the prefill of ``prefill``'s whole, left-padded prompts (as :meth:`prefill`) in one pass: the
        projections and MLPs run once over the decoding rows' tokens and every prompt's tokens together (the
        padding is never computed), each decoding row attends over its own span of the pool and each prompt
        over itself. Returns logits ``[rows + prompt rows, 1, vocab]``: the decoding rows', then each prompt's
        last position's. Requires :attr:`mixes` and caches of one pool. Equivalent to :meth:`decode_groups`
        and :meth:`prefill` one after the other."""
        if not self.mixes:
            raise ValueError(f"stage {self.layers} does not run mixed passes")
        prefill_io, prefill_cache, geometry = prefill
        pool = prefill_cache.pool
        if any(cache.pool is not pool for cache, _ in groups):
            raise ValueError("one call's paged caches must all be blocks of one pool")
        x, prompts = self._input(io), self._input(prefill_io)
        if x.shape[1] != 1 or x.shape[0] != sum(g.batch for _, g in groups):
            raise ValueError(
                f"decode feeds one token per row: {tuple(x.shape)} for groups of {[g.batch for _, g in groups]}"
            )
        if prompts.shape != (geometry.batch, geometry.cur_len):
            raise ValueError(f"prefill feeds all cur_len positions of the microbatch, not {tuple(prompts.shape)}")
        self._check(prefill_cache, geometry, geometry.batch, geometry.cur_len)
        ctx = ForwardContext.combined(self._paged_context(groups), self._blocks_context(prefill_cache, geometry))
        ids = torch.cat([x.view(-1), _packed(prompts, geometry)]).unsqueeze(0)
        # The decoding rows' caches and the prompts' alike: the pool's slabs of each layer, once for each.
        slabs = (((k, k), (v, v)) for k, v in _pool_layers(pool, self.num_layers))
        hidden = self._layers(ids, slabs, ctx)
        rows = x.shape[0]
        last = torch.cat([torch.arange(rows, device=hidden.device), rows + _prompt_ends(geometry, hidden.device)])
        return StageIO(logits=self.logits(hidden[0, last].unsqueeze(1)))

    @functools.cached_property
    def kv_window(self) -> int | None:
        """The sliding window every layer of this stage attends within, or None where a layer attends fully (Gemma
        2/3, Qwen2 below ``max_window_layers``) or none has a window. Only where it is set may a slice's table
        lead with freed blocks (:attr:`Slice.freed`): one table serves every layer, and a global one reads them all."""
        return self.family.window if all(self._local) else None

    @property
    def model_kv_window(self) -> int | None:
        """The sliding window every layer of the whole model attends within (None where one attends fully): what a
        pipeline of several stages may free blocks by, since one block table serves every stage's layers."""
        every = all(i in self.family.windowed_layers for i in range(self.spec.num_layers))
        return self.family.window if every else None

    @functools.cached_property
    def native_slices(self) -> bool:
        """Whether passes of slices (:meth:`forward_slices`) attend in the native kernels: a whole prompt's
        prefill goes straight into blocks here (:attr:`prefills_into_blocks`: the paged kernels are built and the
        family's attention is plainly causal) and the build has the chunk kernel. Otherwise they attend through
        torch (the device-generic path: CUDA, ALiBi, a host without the kernels)."""
        return self.prefills_into_blocks and hasattr(native.load(), "paged_prefill_attention")

    @torch.inference_mode()
    def forward_slices(
        self,
        io: StageIO,
        pool: BlockPool,
        slices: Sequence[Slice],
        all_logits: bool = False,
        on_layer_done: LayerHook | None = None,
        logits_at: Sequence[int] | None = None,
    ) -> StageIO:
        """One pass of per-request slices over ``pool``: slice ``i`` feeds ``length_i`` tokens at positions
        ``[start_i, end_i)`` of its request, whose K/V every layer writes into the request's blocks
        (``slices[i].table``) and which attend causally over the request's positions ``[0, own]`` there (its
        cached prefix and the slice up to itself). Decodes, whole prompts, prompt chunks over their cached prefix
        and prompts after a prefix hit mix freely; the projections and MLPs run once over every token, no padding.

        ``io`` holds every slice's tokens back to back in slice order: ``input_ids`` ``[1, tokens]`` into a first
        stage, ``hidden`` ``[1, tokens, hidden]`` (what a previous stage returned) into the others. Returns
        ``hidden`` ``[1, tokens, hidden]`` from a stage that is not the last, else logits of each slice's last
        token ``[slices, 1, vocab]`` (of every token, ``[1, tokens, vocab]``, with ``all_logits``; of the tokens at
        the pass's indices ``logits_at``, ``[len(logits_at), 1, vocab]``, when given).
        ``on_layer_done(global_layer)`` runs after each layer has written its K/V. Raises ValueError, before
        anything is written, where the slices do not fit the stage, the pool or the input (see
        :meth:`check_slices`)."""
        pieces = tuple(slices)
        self.check_slices(pool, pieces)
        x = self._input(io)
        tokens = sum(piece.length for piece in pieces)
        if tuple(x.shape[:2]) != (1, tokens):
            raise ValueError(f"a pass of slices feeds their {tokens} tokens in one row, not {tuple(x.shape)}")
        dtype = torch_dtype(self.dtype)
        contexts = [self.family.context(BatchGeometry((0,), p.end), p.length, self.device, dtype) for p in pieces]
        ctx = pass_context(
            pieces, contexts, pool.geometry.block_size, pool.slab_blocks, self.native_slices, self.device
        )
        hidden = self._layers(x, _pool_layers(pool, self.num_layers), ctx, on_layer_done)
        if not self.is_last:
            return StageIO(hidden=hidden)
        if all_logits:
            return StageIO(logits=self.logits(hidden))
        if logits_at is None:
            last = torch.tensor(list(itertools.accumulate(p.length for p in pieces)), device=hidden.device) - 1
        else:
            last = torch.tensor(list(logits_at), dtype=torch.long, device=hidden.device)
        return StageIO(logits=self.logits(hidden[0, last].unsqueeze(1)))

    def check_slices(self, pool: BlockPool, slices: Sequence[Slice]) -> None:
        """Raises ValueError unless ``slices`` can run as one pass of this stage over ``pool``: the pool holds
        this stage's layers and heads in its dtype on its device; each slice's table lists blocks of the pool
        (made already) for every position up to its end, distinct ones, its leading freed entries (if any) before
        the window of its first query (:attr:`kv_window`); and no slice writes a block that another slice of the
        pass reads or writes (a block being filled belongs to one request)."""
        if not slices:
            raise ValueError("a pass needs at least one slice")
        block = pool.geometry.block_size
        if pool.geometry != BlockGeometry.of(self.kv_layout(1, 1), block) or pool.device != self.device:
            raise ValueError(f"pool of {pool.geometry} on {pool.device} does not hold stage {self.layers}'s KV")
        made = pool.allocated_blocks
        writer: dict[int, int] = {}
        for i, piece in enumerate(slices):
            blocks = piece.table[: math.ceil(piece.end / block)]
            if len(blocks) * block < piece.end:
                raise ValueError(f"slice {i}'s table of {len(piece.table)} blocks does not reach position {piece.end}")
            self._check_freed(i, piece, block)
            read = blocks[piece.freed :]
            if len(set(read)) != len(read) or max(read) >= made:
                raise ValueError(f"slice {i}'s table {blocks} repeats a block or names one past the pool's {made}")
            for b in blocks[piece.start // block :]:
                writer[b] = writer.get(b, i) if writer.get(b, i) == i else -1
        for i, piece in enumerate(slices):
            for b in piece.table[piece.freed : math.ceil(piece.end / block)]:
                if writer.get(b, i) != i:
                    raise ValueError(f"block {b} is written by one slice of the pass and used by another (slice {i})")

    def _check_freed(self, i: int, piece: Slice, block: int) -> None:
        """Raises ValueError where slice ``i``'s freed blocks hold a position its first query attends."""
        if not piece.freed:
            return
        if self.kv_window is None:
            raise ValueError(f"slice {i}'s table has freed blocks, but a layer of stage {self.layers} reads them all")
        if piece.freed * block > max(0, piece.start - self.kv_window + 1):
            raise ValueError(
                f"slice {i} attends from position {max(0, piece.start - self.kv_window + 1)} (a window of "
                f"{self.kv_window}), but its blocks before position {piece.freed * block} are freed"
            )

    def _natively(
        self, ctx: ForwardContext, contexts: Sequence[ForwardContext], caches: Sequence[KVCache]
    ) -> ForwardContext:
        """``ctx`` with the spans that route a one-token call's attention through the native kernel,
        where this stage uses it and the call fits it: masks that only select positions (no additive
        biases such as ALiBi) and contiguous caches (and, in a stage with sliding-window layers, the spans of those
        layers: ``window_spans``). Otherwise ``ctx`` unchanged."""
        if not self.native_attention:
            return ctx
        if any(c.mask is not None and c.mask.dtype != torch.bool for c in contexts):
            return ctx
        if not all(cache.k.is_contiguous() and cache.v.is_contiguous() for cache in caches):
            return ctx
        geometries = [c.geometry for c in contexts]
        window_spans = decode_spans(geometries, self.family.window) if self.windowed else None
        return replace(ctx, spans=decode_spans(geometries), window_spans=window_spans)

    def _input(self, io: StageIO) -> torch.Tensor:
        """The tensor this stage takes from ``io``, on this stage's device: token ids come from the host and
        hidden states from the data plane (host memory), whatever device the stage computes on."""
        x = io.input_ids if self.is_first else io.hidden
        if x is None:
            raise ValueError(f"stage {self.layers} expects {'input_ids' if self.is_first else 'hidden'}")
        return x if x.device == self.device else x.to(self.device, non_blocking=True)

    def _check(self, cache: AnyCache, geometry: BatchGeometry, batch: int, n: int) -> None:
        layout = cache.layout
        if layout.layer_range != self.layers:
            raise ValueError(f"cache holds layers {layout.layer_range}, stage runs {self.layers}")
        if not batch == geometry.batch or not (
            geometry.batch == layout.batch if geometry.rows is None else geometry.rows[-1] < layout.batch
        ):
            raise ValueError(f"batch mismatch: input {batch}, geometry {geometry.batch}, cache {layout.batch}")
        if not n <= geometry.cur_len <= layout.max_len:
            raise ValueError(f"{n} new tokens up to position {geometry.cur_len} do not fit max_len {layout.max_len}")


def _packed(prompts: torch.Tensor, geometry: BatchGeometry) -> torch.Tensor:
    """Left-padded rows ``[batch, cur_len, ...]`` as their tokens back to back (row r's last ``cur_len - pad_r``
    positions), the padding left out."""
    return torch.cat([prompts[r, pad:] for r, pad in enumerate(geometry.pad_lens)])


def _pool_layers(pool: BlockPool, layers: int) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each of a stage's ``layers`` layers' K and V slabs of ``pool``, in order."""
    return (pool.layer(index) for index in range(layers))


def _whole_prompts(x: torch.Tensor, geometry: BatchGeometry, all_logits: bool) -> bool:
    """Whether ``x`` feeds every position of every row of ``geometry`` (left-padded ``[batch, cur_len, ...]``, or
    the prompts' tokens packed back to back by an earlier stage: ``[1, tokens, ...]``) for their last positions'
    logits: a prefill of whole prompts."""
    if all_logits or geometry.rows is not None:
        return False
    if x.shape[0] == geometry.batch and x.shape[1] == geometry.cur_len:
        return True
    return x.shape[0] == 1 and x.shape[1] == geometry.batch * geometry.cur_len - sum(geometry.pad_lens)


def _prompt_ends(geometry: BatchGeometry, device: torch.device) -> torch.Tensor:
    """Indices of each prompt's last token among :func:`_packed` tokens."""
    lengths = torch.tensor([geometry.cur_len - pad for pad in geometry.pad_lens], device=device)
    return lengths.cumsum(0) - 1
