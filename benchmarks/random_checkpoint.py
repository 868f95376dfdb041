"""A checkpoint of another's architecture with random weights: ``config.json`` (and tokenizer files) copied,
weights drawn by transformers' own initialisation, saved as safetensors under the same names.

For timing the engine where the real weights cannot travel (a lent GPU machine takes a 64 MiB working tree;
SmolLM2-135M's float32 weights are 538 MB): a step's time depends on the shapes, not on the values.
Never for correctness checks against real outputs.

Usage: python benchmarks/random_checkpoint.py --like FOLDER_OR_CONFIG_DIR --out DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# Beside the config.json and weights save_pretrained writes.
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(like: Path, out: Path, seed: int = 0) -> Path:
    """Write the random checkpoint of ``like``'s architecture into ``out`` (created); returns ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (like / "config.json").is_file():
        raise FileNotFoundError(f"{like / 'config.json'} not found")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(like)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in COPIED:
        if (like / name).is_file():
            shutil.copy2(like / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, required=True, help="a checkpoint folder (config.json is enough)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.like, args.out, args.seed))


if __name__ == "__main__":
    main()
