"""One module per ``dejavu`` subcommand; each defines ``register(subparsers)``.

A module sets the chosen handler with ``parser.set_defaults(func=...)``; the handler takes the
parsed arguments and returns the process exit code. Modules import heavy packages (torch, the
engine) inside their handlers, so ``dejavu --help`` stays fast.
"""
