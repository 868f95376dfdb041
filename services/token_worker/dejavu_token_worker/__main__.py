"""`python -m dejavu_token_worker`: run one token worker."""

from __future__ import annotations

import sys

from dejavu_worker.main import worker_main


def main() -> int:
    return worker_main("token", "dejavu_token_worker.worker:TokenWorker")


if __name__ == "__main__":
    sys.exit(main())
