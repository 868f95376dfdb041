"""The scheduling policy of a pipeline and the books of its KV pool: pure Python, no torch.

One policy (:class:`Scheduler`) decides every pass of a pipeline: the pipeline's first stage runs it before each
pass, and the planner's simulator runs the same object over simulated time. See :mod:`.policy`, :mod:`.blocks` and
:mod:`.state`.
"""

from dejavu_common.sched.blocks import FREED, BlockBook, BookStats, OutOfBlocks, chain_hashes
from dejavu_common.sched.policy import Budget, RequestTooLong, ScheduledPass, Scheduler, Slice, most_blocks
from dejavu_common.sched.state import IllegalTransition, RequestState, Status

__all__ = [
    "FREED",
    "BlockBook",
    "BookStats",
    "Budget",
    "IllegalTransition",
    "OutOfBlocks",
    "RequestState",
    "RequestTooLong",
    "ScheduledPass",
    "Scheduler",
    "Slice",
    "Status",
    "chain_hashes",
    "most_blocks",
]
