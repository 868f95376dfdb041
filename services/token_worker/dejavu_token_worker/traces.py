"""Token stage 0's spans of a microbatch's requests (``dejavu_common.tracing``), one phase at a time.

A member of a cohort has one span per traced row: ``dejavu.prompt`` while it runs its colocated prefill
(step 0), then ``dejavu.decode`` from the step it decodes first until the row finishes or the microbatch
leaves. A member resumed after a repair opens a new ``dejavu.decode`` (attribute ``dejavu.resumed``: it
did not start decoding here). Nothing is made per pass: a pass's return only ends the spans of rows that
finished, and only for a member that has spans (None otherwise).
"""

from __future__ import annotations

from dejavu_common import tracing
from dejavu_common.messages import MicrobatchSpec
from dejavu_common.tracing import RowSpans

PROMPT = "dejavu.prompt"
DECODE = "dejavu.decode"


class MemberTrace:
    """The open spans of one microbatch at token stage 0."""

    def __init__(self, spec: MicrobatchSpec, spans: RowSpans, phase: str, epoch: int) -> None:
        self.spec = spec
        self.spans = spans
        self.phase = phase
        self.epoch = epoch

    @classmethod
    def start(cls, spec: MicrobatchSpec, step: int, live: tuple[int, ...], epoch: int) -> MemberTrace | None:
        """The spans of ``spec``'s microbatch joining a cohort at ``step`` with rows ``live``; None when
        tracing is off or none of its rows is traced."""
        if not tracing.enabled():
            return None
        phase = PROMPT if step == 0 else DECODE
        attributes = {tracing.STAGE: 0, "dejavu.epoch": epoch, "dejavu.step": step, "dejavu.resumed": step > 1}
        spans = RowSpans.start(phase, spec.rows, attributes, only=live, mb_id=spec.mb_id)
        return cls(spec, spans, phase, epoch) if spans is not None else None

    def stepped(self, step: int, live: tuple[int, ...]) -> None:
        """A pass returned and the member runs ``step`` next with rows ``live``: rows that finished end their
        spans; after its prefill, the prompt spans end (event ``first_token``) and the decode spans begin."""
        if self.phase == PROMPT:
            self.spans.event("first_token")
            self.spans.end(attributes={"dejavu.steps": 1})
            attributes = {tracing.STAGE: 0, "dejavu.epoch": self.epoch, "dejavu.step": step, "dejavu.resumed": False}
            spans = RowSpans.start(DECODE, self.spec.rows, attributes, only=live, mb_id=self.spec.mb_id)
            self.spans = spans if spans is not None else RowSpans({})
            self.phase = DECODE
        else:
            self.spans.end_except(live, {"dejavu.last_step": step - 1})

    def event(self, name: str) -> None:
        self.spans.event(name)

    def left(self, step: int, error: BaseException | str | None = None) -> None:
        """The microbatch leaves the cohort at ``step`` (finished, failed with ``error``, or interrupted by a
        new epoch): every open span ends."""
        if error is not None:
            self.spans.fail(error)
        else:
            self.spans.end(attributes={"dejavu.last_step": step})
