"""Native CPU kernels, built once per host from the C++ in ``csrc/`` (the CPU seam).

:func:`decode_attention` attends one query token per row over many caches in one call: each row
reads its own group's cache over its own span. Iteration-level batching needs exactly that (every
microbatch of a pass at its own length); without it a pass makes one attention call per microbatch
per layer, whose fixed cost grows with the number of microbatches. :func:`paged_decode_attention` is
the same over a paged cache: fixed-size blocks in shared slabs, each row's found through its block table.
:func:`prefill_attention` is a prefill's causal attention over whole prompts packed back to back (a ragged
prefill's segments, or an unpadded batch's rows), each prompt over its own tokens, in one call: 2-5x torch's
CPU flash attention on SmolLM2's heads (docs/benchmarks.md).
Both take float32 or bfloat16 (:data:`DTYPES`); bfloat16 keys and values are widened as they are read,
and scores, softmax and sums are float32, the output rounded once (as torch's CPU attention does).
:func:`rms_norm` and :func:`silu_mul` are a Llama layer's pointwise ops, one pass each instead of several torch
ops (with their dispatch and temporaries); a stage with the kernels uses them (``Family.kernels``) where they
are vectorized (AVX-512 hosts: ``POINTWISE_FAST``; the scalar loops elsewhere are slower than torch's ops).

The extension is compiled with the host's compiler the first time a process asks for it (ninja and
g++, about 30 s on the reference host) into ``$DEJAVU_KERNEL_CACHE`` (default
``~/.cache/dejavu/kernels``), keyed by the source, torch's version and the CPU's flags, so a build is
reused only where it was made for; ``make setup`` builds it ahead (``python -m dejavu_engine.native``).
Where it cannot be built (no compiler), :func:`load` returns None and stages use torch's attention
per microbatch (and its pointwise ops): same results, slower. ``engine.native_attention``
(``Stage(native_attention=...)``) turns all of them off. CUDA never takes this path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("dejavu.engine.kernels")

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
DTYPES = ("float32", "bfloat16")  # the kernels' dtypes: every tensor of a call has one of them
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_key() -> str:
    """What a build is valid for: the source, the compile flags, torch's version and the CPU."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("DEJAVU_KERNEL_CACHE", Path.home() / ".cache" / "dejavu" / "kernels"))


def load() -> ModuleType | None:
    """The compiled kernels, built on first use; None where they cannot be built (the reason is
    logged once)."""
    global _module, _tried
    if _module is not None or _tried:
        return _module
    with _lock:
        if _module is not None or _tried:
            return _module
        _tried = True
        try:
            _module = _build()
        except Exception as exc:  # a compiler's failure has many shapes; all of them mean "fall back"
            log.warning("native kernels unavailable, attention runs per microbatch: %s", str(exc)[-600:])
            _module = None
        return _module


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    key = build_key()
    folder = cache_dir() / key
    folder.mkdir(parents=True, exist_ok=True)
    # ninja and the compiler are looked up on PATH; the venv's own bin (PyPI's ninja) may not be on it.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    return cpp_extension.load(
        name=f"dejavu_kernels_{key}",
        sources=[str(SOURCE)],
        extra_cflags=list(FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One-token attention of every row of ``q`` (``[rows, heads, head_dim]``, float32 or bfloat16) over its own
    cache and span. ``rows[r] = (group, index, start, end)``: row ``r`` writes its new key and value
    (``k_new[r]``, ``v_new[r]``: ``[kv_heads, head_dim]``) at position ``end - 1`` of row ``index`` of
    ``k_caches[group]`` / ``v_caches[group]`` (each ``[batch, kv_heads, max_len, head_dim]``,
    contiguous, of ``q``'s dtype), then attends positions ``[start, end)`` there. Returns ``[rows, heads,
    head_dim]`` of ``q``'s dtype.
    Raises RuntimeError where the kernels are not loaded or the arguments do not fit."""
    module = load()
    if module is None:
        raise RuntimeError("native kernels are not available")
    with torch.profiler.record_function("dejavu::decode_attention"):  # named in profiles like torch's ops
        return module.decode_attention(q, k_new, v_new, k_caches, v_caches, rows, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_slabs: list[torch.Tensor],
    v_slabs: list[torch.Tensor],
    tables: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`decode_attention` over a paged cache. Keys and values live in blocks of ``block_size``
    positions held by slabs (``k_slabs`` / ``v_slabs``: each ``[slab_blocks, kv_heads, block_size,
    head_dim]``, contiguous, of ``q``'s dtype, all of one shape); block id ``b`` is index ``b % slab_blocks`` of
    slab ``b // slab_blocks``. ``tables[r, i]`` (int64 ``[rows, max_blocks]``, -1 for none) is the block
    holding row ``r``'s logical positions ``[i * block_size, (i + 1) * block_size)``, and ``spans[r] =
    (start, end)`` (int64 ``[rows, 2]``): row ``r`` writes ``k_new[r]``, ``v_new[r]`` (``[kv_heads,
    head_dim]``) at logical position ``end - 1``, then attends positions ``[start, end)``. Rows write
    in parallel, so no two rows may write one slot, nor may one row read a slot another writes.
    Returns ``[rows, heads, head_dim]``. Raises RuntimeError where the kernels are not loaded or the
    arguments do not fit (a span past its table, a block it touches that is -1 or not in the slabs)."""
    module = load()
    if module is None:
        raise RuntimeError("native kernels are not available")
    with torch.profiler.record_function("dejavu::paged_decode_attention"):
        return module.paged_decode_attention(q, k_new, v_new, k_slabs, v_slabs, tables, spans, scale)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of whole prompts packed back to back, each over its own tokens only. ``q``
    (``[tokens, heads, head_dim]``), ``k`` and ``v`` (``[tokens, kv_heads, head_dim]``) are float32 or bfloat16,
    of one dtype, possibly strided views whose last dimension is contiguous; ``segments[s] = (offset, length)``
    (int64 ``[segments, 2]``, not overlapping): tokens ``[offset, offset + length)`` are one prompt, whose query
    ``i`` attends its keys ``0..i`` (SDPA's ``is_causal`` on the prompt alone). Returns ``[tokens, heads,
    head_dim]``, contiguous, of ``q``'s dtype (tokens in no segment are 0). Raises RuntimeError where the kernels
    are not loaded or the arguments do not fit."""
    module = load()
    if module is None:
        raise RuntimeError("native kernels are not available")
    with torch.profiler.record_function("dejavu::prefill_attention"):
        return module.prefill_attention(q, k, v, segments, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension of ``x`` (contiguous, float32 or bfloat16, any leading dimensions),
    scaled by ``weight`` (``[hidden]``, of ``x``'s dtype), in one pass: transformers' arithmetic
    (:func:`dejavu_engine.families.llama.rms_norm`), so bfloat16 results are torch's and float32 ones differ
    only by the order of the sum of squares. Raises RuntimeError where the kernels are not loaded or the
    arguments do not fit."""
    return _require().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up = [..., gate | up]`` (contiguous, float32 or bfloat16) in one
    pass, rounded where torch's two ops round. Returns ``[..., width / 2]``."""
    return _require().silu_mul(gate_up)


def _require() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("native kernels are not available")
    return module


if __name__ == "__main__":  # make setup: build ahead, so no worker or test waits for the compiler
    logging.basicConfig(level=logging.INFO)
    if load() is None:
        print("native kernels could not be built; attention will run per microbatch")
        sys.exit(0)
    else:
        print(f"native kernels ready in {cache_dir() / build_key()}")
