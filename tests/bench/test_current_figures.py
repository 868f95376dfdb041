"""docs/benchmarks.md's current figures: every image and file it links to exists (images small), and the
results its plots were drawn from (``benchmarks/results/current/``) are results the plots accept, each
workload's systems comparable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.plots import check_comparable, load_result, plot_chaos, read_serve

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
CURRENT = ROOT / "benchmarks" / "results" / "current"
MAX_IMAGE_BYTES = 200_000


def _links(doc: Path) -> list[str]:
    """Relative link targets of a markdown file (images and links), without anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
    return [t.split("#")[0] for t in targets if not t.startswith(("http://", "https://", "#"))]


@pytest.mark.parametrize("doc", [DOC, ROOT / "benchmarks" / "results" / "history.md"], ids=lambda p: p.name)
def test_every_linked_file_exists_and_images_are_small(doc: Path) -> None:
    links = _links(doc)
    assert links, f"{doc} links to nothing"
    for target in links:
        path = (doc.parent / target).resolve()
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"
        if path.suffix == ".png":
            assert path.stat().st_size < MAX_IMAGE_BYTES, f"{target} is {path.stat().st_size} bytes"


def test_the_current_serve_results_are_comparable_per_workload() -> None:
    workloads = sorted(p for p in CURRENT.glob("serve-*") if p.is_dir())
    assert workloads
    for folder in workloads:
        results = [read_serve(path) for path in sorted(folder.glob("*.json"))]
        assert len(results) >= 2, f"{folder.name}: nothing to compare"
        check_comparable(results)
        assert f"img/{folder.name}.png" in DOC.read_text()  # each workload's plot is in the document


def test_the_current_chaos_result_plots(tmp_path: Path) -> None:
    plot_chaos(load_result(CURRENT / "chaos.json"), tmp_path / "chaos.png", "current", "chaos.json")
    assert (tmp_path / "chaos.png").stat().st_size > 0
