"""``dejavu generate``: one prompt through K in-process stages of the engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="Generate a completion offline with K in-process stages.")
    parser.add_argument("--prompt", required=True, help="Prompt text.")
    parser.add_argument("--chat", action="store_true", help="Render the prompt as a user message of the chat template.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate at most (default 64).")
    parser.add_argument("--stages", type=int, default=1, help="Pipeline stages to split the layers into (default 1).")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default 1 = off).")
    parser.add_argument("--top-k", type=int, default=0, help="Top-k sampling (default 0 = off).")
    parser.add_argument("--min-p", type=float, default=0.0, help="Min-p sampling (default 0 = off).")
    parser.add_argument("--min-tokens", type=int, default=0, help="Tokens to generate before EOS may end it.")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's repetition penalty (1 = off).")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty (0 = off).")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty (0 = off).")
    parser.add_argument("--seed", type=int, help="Sampling seed (default: random).")
    parser.add_argument(
        "--token-budget",
        type=int,
        help="Compute the prompt in chunks of this many tokens a pass (chunked prefill; default: whole).",
    )
    parser.add_argument("--model", type=Path, help="Checkpoint folder (default: the prepared SmolLM2).")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="Weights and KV dtype (default: settings, float32)."
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the text.")
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Generate and print the text (or the JSON result); user errors become one-line CLI errors."""
    from dejavu_cli.main import CLIError
    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import TokenizerError
    from dejavu_engine.checkpoint import CheckpointError
    from dejavu_engine.generate import GenerationError, generate
    from dejavu_engine.threads import configure_torch_threads

    if args.model is not None and not args.model.is_dir():
        raise CLIError(f"model folder not found: {args.model}")
    settings = Settings()
    if args.dtype:
        settings = settings.model_copy(update={"model": settings.model.model_copy(update={"dtype": args.dtype})})
    configure_torch_threads(settings.engine.torch_threads)
    try:
        result = generate(
            args.prompt,
            chat=args.chat,
            max_tokens=args.max_tokens,
            stages=args.stages,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            token_budget=args.token_budget,
            model=args.model,
            settings=settings,
            min_p=args.min_p,
            min_tokens=args.min_tokens,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        )
    except (GenerationError, CheckpointError, TokenizerError) as exc:
        raise CLIError(str(exc)) from exc
    print(json.dumps(result.to_json(), ensure_ascii=False) if args.json else result.text)
    return 0
