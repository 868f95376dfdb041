"""`python -m dejavu_prompt_worker`: run one prompt worker."""

from __future__ import annotations

import sys

from dejavu_worker.main import worker_main


def main() -> int:
    return worker_main("prompt", "dejavu_prompt_worker.worker:PromptWorker")


if __name__ == "__main__":
    sys.exit(main())
