"""Native CPU kernels, built once per host from the C++ in ``csrc/`` (the CPU seam).

:func:`decode_attention` attends one query token per row over many caches in one call: each row
reads its own group's cache over its own span. Iteration-level batching needs exactly that (every
microbatch of a pass at its own length); without it a pass makes one attention call per microbatch
per layer, whose fixed cost grows with the number of microbatches. :func:`paged_decode_attention` is
the same over a paged cache: fixed-size blocks in shared slabs, each row's found through its block table.
:func:`prefill_attention` is a prefill's causal attention over whole prompts packed back to back (a ragged
prefill's segments, or an unpadded batch's rows), each prompt over its own tokens, in one call: 2-5x torch's
CPU flash attention on SmolLM2's heads (docs/benchmarks.md). :func:`paged_prefill_attention` is the same kernel
over a paged cache, for prompt chunks that attend over their sequence's cached prefix too (chunked prefill, a
prefix-cache hit), and :func:`paged_write` puts a pass's new keys and values into their blocks.
Both take float32 or bfloat16 (:data:`DTYPES`); scores, softmax and sums are float32 and the output is rounded
once (as torch's CPU attention does): bfloat16 keys and values are widened as they are read, or, where the CPU
has AVX512-BF16, multiplied on its bfloat16 dot products (each probability rounded to bfloat16 first, as torch
rounds it).
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

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("dejavu.engine.kernels")

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
QUANT_SOURCE = Path(__file__).parent / "csrc" / "quant.cpp"  # weight-only quantized GEMMs (dejavu_engine.quant)
QUANT_GEMM_SOURCE = Path(__file__).parent / "csrc" / "quant_gemm.cpp"  # their many-row GEMM on int8 dot products
DTYPES = ("float32", "bfloat16")  # the kernels' dtypes: every tensor of a call has one of them


# Levels that are an -march level plus features: x86-64-v4 with AVX512-BF16 (Cooper Lake, Sapphire Rapids,
# Zen 4 on), whose bfloat16 dot products the bfloat16 decode and prefill kernels use, and AVX512-VNNI (every
# CPU with AVX512-BF16 has it), whose int8 dot products the quantized many-row GEMM uses.
_LEVEL_FEATURES = {"x86-64-v4-bf16": ("x86-64-v4", ("-mavx512bf16", "-mavx512vnni"))}


def compile_flags(march: str = "native") -> tuple[str, ...]:
    """The compiler's flags for a build for ``march``: ``native`` (this host's CPU) or a level of
    :data:`PORTABLE`."""
    arch, features = _LEVEL_FEATURES.get(march, (march, ()))
    return ("-O3", f"-march={arch}", *features, "-fopenmp", "-fno-math-errno")


# CPU levels a build can be made for ahead of time, on another machine (a container image), best first,
# with the /proc/cpuinfo flags each needs: where no compiler is at hand, a host loads the best one it can run.
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "sse4_1", "sse4_2", "ssse3", "popcnt"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# (x86-64 hosts older than AVX2, about 2013, build for themselves or run without the kernels.)
PORTABLE: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4-bf16", _V4 | {"avx512_bf16", "avx512_vnni"}),
    ("x86-64-v4", _V4),
    ("x86-64-v3", _V3),
)

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


@functools.cache
def _cpu_flag_set() -> frozenset[str]:
    return frozenset(_cpu_flags().split())


def build_key(march: str = "native") -> str:
    """What a build is valid for: the source, the compile flags, torch's version, the Python environment
    (its prefix: torch's build of the extension names the environment's include paths, so two environments
    sharing one cache would otherwise rebuild it in turn, each ~40 s), and (``native``: built for this very
    CPU) the CPU's flags."""
    h = hashlib.sha256()
    cpu = _cpu_flags() if march == "native" else ""
    flags = " ".join(compile_flags(march))
    h.update(QUANT_SOURCE.read_bytes())
    h.update(QUANT_GEMM_SOURCE.read_bytes())
    for part in (SOURCE.read_bytes(), flags.encode(), torch.__version__.encode(), sys.prefix.encode(), cpu.encode()):
        h.update(part)
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("DEJAVU_KERNEL_CACHE", Path.home() / ".cache" / "dejavu" / "kernels"))


def prebuilt_dir() -> Path:
    """Where builds made ahead for CPU levels are: ``share/dejavu/kernels`` of the Python environment they
    were built for (the images build them there), or ``$DEJAVU_KERNEL_PREBUILT``."""
    folder = os.environ.get("DEJAVU_KERNEL_PREBUILT")
    return Path(folder) if folder else Path(sys.prefix) / "share" / "dejavu" / "kernels"


def load() -> ModuleType | None:
    """The compiled kernels: built for this host on first use where a compiler is at hand (or found built
    already), else the best build made ahead for a CPU level this host runs (:func:`build_portable`); None
    where there is neither (the reason is logged once)."""
    global _module, _tried
    if _module is not None or _tried:
        return _module
    with _lock:
        if _module is not None or _tried:
            return _module
        _tried = True
        error: Exception | None = None
        if _compiler() is not None or _built(build_key()) is not None:
            try:
                _module = _build()
                return _module
            except Exception as exc:  # a compiler's failure has many shapes; all of them mean "fall back"
                error = exc
        _module = _load_prebuilt()
        if _module is None:
            reason = str(error)[-600:] if error is not None else "no C++ compiler and no build made ahead for this CPU"
            log.warning("native kernels unavailable, attention runs per microbatch: %s", reason)
        return _module


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _built(key: str) -> Path | None:
    """This host's earlier build of ``key``, if its library is there."""
    path = cache_dir() / key / f"dejavu_kernels_{key}.so"
    return path if path.exists() else None


def _load_prebuilt() -> ModuleType | None:
    folder = prebuilt_dir()
    if not folder.is_dir():
        return None
    flags = set(_cpu_flags().split())
    for march, needs in PORTABLE:
        if not needs <= flags:
            continue
        key = build_key(march)
        path = folder / march / f"dejavu_kernels_{key}.so"
        if not path.exists():
            continue
        try:
            module = _import(path, f"dejavu_kernels_{key}")
        except Exception as exc:  # e.g. made for another Python or torch: the next level may still do
            log.warning("prebuilt native kernels %s do not load here: %s", path, exc)
            continue
        log.info("native kernels: the build made ahead for %s (%s)", march, path)
        return module
    return None


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(march: str = "native", folder: Path | None = None) -> ModuleType:
    from torch.utils import cpp_extension

    key = build_key(march)
    folder = folder or cache_dir() / key
    folder.mkdir(parents=True, exist_ok=True)
    # ninja and the compiler are looked up on PATH; the venv's own bin (PyPI's ninja) may not be on it.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    return cpp_extension.load(
        name=f"dejavu_kernels_{key}",
        sources=[str(SOURCE), str(QUANT_SOURCE), str(QUANT_GEMM_SOURCE)],
        extra_cflags=list(compile_flags(march)),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def build_portable(folder: Path) -> list[Path]:
    """Build the kernels for every CPU level of :data:`PORTABLE` into ``folder/<level>/`` (the library
    alone), for hosts without a compiler that run this torch and Python: what the worker images carry."""
    out = []
    for march, _needs in PORTABLE:
        key = build_key(march)
        work = folder / ".build" / march
        _build(march, work)
        target = folder / march
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(work / f"dejavu_kernels_{key}.so", target / f"dejavu_kernels_{key}.so")
        out.append(target / f"dejavu_kernels_{key}.so")
    shutil.rmtree(folder / ".build", ignore_errors=True)
    return out


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
    module = _require()
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
    module = _require()
    with torch.profiler.record_function("dejavu::paged_decode_attention"):
        return module.paged_decode_attention(q, k_new, v_new, k_slabs, v_slabs, tables, spans, scale)


# From this many tokens on, a bfloat16 prompt attends faster through torch's CPU flash attention than through
# prefill_attention where the CPU has AMX (the kernel alone, 2 threads, SmolLM2's heads, alternated in one process on
# a 2-core Xeon with AMX, 2026-11-26: 4 x 64 tokens 0.30 / 0.48 ms, 4 x 128 1.02 / 1.07, 8 x 192 3.42 / 2.87,
# 4 x 256 2.90 / 2.17, 2 x 512 5.90 / 3.79, 1 x 1000 9.63 / 5.64; kernel / torch).
AMX_TORCH_PREFILL_FROM = 160


def torch_prefill_from(dtype: torch.dtype) -> int | None:
    """The prompt length from which :func:`prefill_attention` hands a prompt to torch's CPU flash attention on
    this host (None: never). Only bfloat16 on a CPU with AMX: there torch's flash attention multiplies its
    tiles on the matrix units (oneDNN's brgemm), which the kernel's AVX512-BF16 dot products match only for
    short prompts (:data:`AMX_TORCH_PREFILL_FROM`). Elsewhere, and for float32 (AMX has no float32 tiles), the
    kernel is the faster at every length."""
    if dtype == torch.bfloat16 and "amx_bf16" in _cpu_flag_set():
        return AMX_TORCH_PREFILL_FROM
    return None


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
    module = _require()
    with torch.profiler.record_function("dejavu::prefill_attention"):
        return module.prefill_attention(q, k, v, segments, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_slabs: list[torch.Tensor],
    v_slabs: list[torch.Tensor],
    tables: torch.Tensor,
    segments: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of prompt chunks packed back to back, each over its own sequence's keys in a paged cache
    (slabs as in :func:`paged_decode_attention`). ``segments[s] = (offset, length, start)`` (int64 ``[segments,
    3]``, not overlapping): tokens ``[offset, offset + length)`` of ``q`` (``[tokens, heads, head_dim]``, float32
    or bfloat16, a strided view whose last dimension is contiguous) sit at positions ``[start, start + length)``
    of the sequence whose blocks ``tables[s]`` (int64 ``[segments, max_blocks]``) lists, and the query at
    position ``p`` attends over that sequence's keys and values ``[0, p]``, read from its blocks: a whole prompt
    (``start = 0``), or a chunk over its cached prefix. Every position read must be in the blocks already (write a
    chunk's own K/V first: :func:`paged_write` without ``clear_before``). The arithmetic is
    :func:`prefill_attention`'s over the same keys. Returns ``[tokens, heads, head_dim]``, contiguous, of ``q``'s
    dtype (tokens in no segment are 0). Raises RuntimeError where the kernels are not loaded or the arguments do
    not fit (a block it would read that is -1 or not in the slabs)."""
    module = _require()
    with torch.profiler.record_function("dejavu::paged_prefill_attention"):
        return module.paged_prefill_attention(q, k_slabs, v_slabs, tables, segments, scale)


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


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotary embedding ``x * cos + swap_halves(x) * sin`` of the first ``heads`` heads of ``x`` (``[...,
    all heads, head_dim]``, contiguous, float32 or bfloat16: a fused QKV projection), in place, in one pass;
    ``cos`` and ``sin`` hold a ``[head_dim]`` row per row of ``x`` (contiguous, of ``x``'s dtype, the sign of
    rotate_half in ``sin``). Each product is rounded before the sum, as transformers' ``q * cos + rotate_half(q) *
    sin`` rounds, so the results are its results bit for bit in both dtypes (the float32 fallback,
    :func:`dejavu_engine.families.llama.rotate`, fuses one product into the sum: a last-bit difference). Returns
    ``x``."""
    _require().rope_(x, cos, sin, heads)
    return x


def paged_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_slabs: list[torch.Tensor],
    v_slabs: list[torch.Tensor],
    tables: torch.Tensor,
    places: torch.Tensor,
    clear_before: bool = True,
) -> None:
    """Write a prefill's keys and values into their blocks of a paged cache (slabs as in
    :func:`paged_decode_attention`). ``k`` and ``v`` (``[tokens, kv_heads, head_dim]``, strided views whose last
    dimension is contiguous) hold the prompts' tokens back to back; ``places[s] = (offset, start, end)`` (int64
    ``[segments, 3]``): tokens ``[offset, offset + end - start)`` go to logical positions ``[start, end)`` of the
    row whose blocks ``tables[s]`` (int64 ``[segments, max_blocks]``) lists. With ``clear_before`` the positions of
    that row's first block before ``start`` (a whole prompt's left padding) are cleared, as a contiguous cache's;
    without, they are left as they are (a sequence's cached prefix, before a chunk of it or a decode step). Raises
    RuntimeError where the kernels are not loaded or the arguments do not fit (a block it would write that is -1
    or not in the slabs)."""
    module = _require()
    with torch.profiler.record_function("dejavu::paged_write"):
        module.paged_write(k, v, k_slabs, v_slabs, tables, places, clear_before)


def _require() -> ModuleType:
    """The loaded kernels; RuntimeError where there are none."""
    module = load()
    if module is None:
        raise RuntimeError("native kernels are not available")
    return module


if __name__ == "__main__":  # make setup: build ahead, so no worker or test waits for the compiler
    logging.basicConfig(level=logging.INFO)
    if len(sys.argv) == 3 and sys.argv[1] == "--portable":  # the images: a build per CPU level
        for path in build_portable(Path(sys.argv[2])):
            print(f"built {path}")
        sys.exit(0)
    if _compiler() is not None:  # a compiler is here: a failed build is an error, not a fallback
        try:
            _build()
        except Exception as exc:
            print(f"native kernels failed to build with {_compiler()}:\n{str(exc)[-2000:]}", file=sys.stderr)
            sys.exit(1)
        print(f"native kernels ready in {cache_dir() / build_key()}")
    elif load() is None:
        print("no C++ compiler and no build made ahead for this CPU; attention will run per microbatch")
    else:
        print("no C++ compiler: using the native kernels' build made ahead for this CPU level")
