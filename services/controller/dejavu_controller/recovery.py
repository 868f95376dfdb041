"""Where a repaired token pipeline resumes (pure logic; the paper's recovery step 4).

After a failure every token stage holds, per in-flight microbatch, its KV up to some step: a
survivor its own cache (it reports the last step it ran), a replaced stage the replica its
successor kept (the replication watermark), unless that replica is gone too (the successor failed
as well, or the pipeline has one stage, or replication is off). Stages run a microbatch's steps in
pipeline order, so a later stage may be a step behind an earlier one; the pipeline therefore resumes
each microbatch at one past the *minimum* over all stages, re-executing steps some stages already
ran (their writes are identical, and the controller drops the duplicate tokens). A microbatch that
some stage holds no prompt KV for re-runs its prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dejavu_common.messages import ResumePoint


def replica_available(stage: int, depth: int, failed: set[int]) -> bool:
    """Whether the replica of ``stage``'s cache survived: it lives on stage (stage + 1) mod depth."""
    holder = (stage + 1) % depth
    return depth > 1 and holder not in failed


def plan_resume(
    epoch: int,
    depth: int,
    microbatches: Iterable[int],
    failed: set[int],
    progress: Mapping[int, Mapping[int, int]],
    watermarks: Mapping[int, Mapping[int, int]],
    replication: bool = True,
) -> ResumePoint:
    """The resume step of each microbatch, or its prompt re-run.

    ``progress[stage][mb]`` is a survivor's last held step (-1: prompt KV incomplete);
    ``watermarks[stage][mb]`` the last step of ``stage``'s cache replicated on its successor.
    """
    resume: dict[int, int] = {}
    rerun: list[int] = []
    for mb in sorted(set(microbatches)):
        held: list[int] = []
        for stage in range(depth):
            if stage in failed:
                ok = replication and replica_available(stage, depth, failed)
                held.append(watermarks.get(stage, {}).get(mb, -1) if ok else -1)
            else:
                held.append(progress.get(stage, {}).get(mb, -1))
        low = min(held)
        if low < 0:
            rerun.append(mb)
        else:
            resume[mb] = low + 1
    return ResumePoint(epoch=epoch, resume=resume, rerun=tuple(rerun))
