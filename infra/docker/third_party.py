"""Print the third-party dependencies of the given package folders, one per line, for `pip install -r`.

The images install these before copying the packages' code, so that a code change rebuilds only the cheap
layers (Docker's cache keys a RUN step on the files copied before it). Dependencies on DejaVu's own
packages (names starting with 'dejavu') are left out: they are installed from their folders afterwards.

Usage: python third_party.py FOLDER [FOLDER...]   (each FOLDER holds a pyproject.toml)
"""

import re
import sys
import tomllib
from pathlib import Path


def third_party(folder: Path) -> list[str]:
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return [dep for dep in project.get("dependencies", []) if not re.match(r"dejavu", dep, re.IGNORECASE)]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n".join(sorted({dep for folder in sys.argv[1:] for dep in third_party(Path(folder))})))
