"""PNG figures: makespan and cost against machines, and a pipeline timeline like the paper's Fig. 3."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt

from dejavu_planner.result import SimResult
from dejavu_planner.sweep import ScalingPoint

MAX_TIMELINE_SEGMENTS = 5000  # beyond this a timeline is unreadable (and slow to draw)


def plot_scaling(points: list[ScalingPoint], path: Path, title: str = "") -> None:
    """Two panels, makespan and cost, against machines; one line per policy."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(p.policy for p in points):
        mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.machines)
        xs = [p.machines for p in mine]
        left.plot(xs, [p.makespan_s for p in mine], marker="o", label=policy)
        right.plot(xs, [p.cost for p in mine], marker="o", label=policy)
    left.set(xlabel="machines", ylabel="makespan (s)", title="Makespan")
    right.set(xlabel="machines", ylabel="cost (machines × hours × price)", title="Cost")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(result: SimResult, path: Path) -> None:
    """Which stage runs which microbatch when: ``Pk`` is microbatch k's prompt, ``k.j`` its j-th token.

    Requires a result simulated with ``record_timeline=True``; raises ``ValueError`` when the
    timeline is empty or too large to read.
    """
    segments = result.timeline
    if not segments:
        raise ValueError("no timeline recorded: simulate with record_timeline=True")
    if len(segments) > MAX_TIMELINE_SEGMENTS:
        raise ValueError(f"{len(segments)} segments: too many to draw; use a smaller trace")
    rows = list(dict.fromkeys((s.pipeline, s.stage) for s in sorted(segments, key=lambda s: (s.pipeline, s.stage))))
    height = 0.8
    fig, ax = plt.subplots(figsize=(min(4 + len(segments) * 0.12, 40), 1 + 0.5 * len(rows)))
    colors = plt.get_cmap("tab10")
    min_labelled = 0.02 * max(s.end_s for s in segments)
    for s in segments:
        y = rows.index((s.pipeline, s.stage))
        width = s.end_s - s.start_s
        color = colors(s.microbatch % 10)
        ax.barh(y, width, left=s.start_s, height=height, color=color, alpha=0.35 if s.step else 0.9, edgecolor="black")
        if width >= min_labelled:  # narrow token steps stay unlabelled rather than overprint
            label = f"P{s.microbatch}" if s.step == 0 else f"{s.microbatch}.{s.step}"
            ax.text(s.start_s + width / 2, y, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{p} stage {k + 1}" for p, k in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"{result.deployment.label()}: makespan {result.makespan_s:.2f} s (white gaps are bubbles)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
