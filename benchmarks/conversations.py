"""A multi-turn chat workload: conversations that re-send their history, as a chat client does.

:class:`MultiTurnDataset` is ``num_conversations`` conversations of ``num_turns`` turns. Turn ``t`` of a
conversation sends the whole history through ``/v1/chat/completions``: every earlier user message and
the server's own earlier answers (the text it streamed), then a new user message of ``user_len``
tokens, asking ``output_len`` tokens. A conversation's next turn is sent only once its previous answer
has arrived (and ``think_time_s`` has passed); the conversations run concurrently, starting at the
arrival times of the run's request rate (``inf``: all at once). A server with a prefix cache computes
only the new message of a later turn, so the later turns' TTFT is the figure to compare with turn 1's.

User messages are texts of common words that the model's tokenizer encodes to exactly ``user_len``
tokens (:class:`benchmarks.loadgen.PromptBuilder`), seeded by (seed, conversation, turn): two runs, or
two servers, get the same user messages; the answers are each server's own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.dataset import arrival_times
from benchmarks.loadgen import Chat, LoadGenerator, PromptBuilder, RequestRecord, Status
from benchmarks.metrics import Summary
from dejavu_planner.trace import Request

if TYPE_CHECKING:
    import httpx

    from dejavu_common.tokenizer import Tokenizer


@dataclass(frozen=True)
class MultiTurnDataset:
    """The shape of the conversations (module docstring); lengths in tokens."""

    num_conversations: int
    num_turns: int
    user_len: int
    output_len: int
    think_time_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.user_len, self.output_len) < 1:
            raise ValueError("num_conversations, num_turns, user_len and output_len must be >= 1")
        if not 0 <= self.think_time_s < float("inf"):
            raise ValueError(f"think_time_s must be >= 0 and finite (got {self.think_time_s})")

    @property
    def requests(self) -> int:
        return self.num_conversations * self.num_turns

    def rid(self, conversation: int, turn: int) -> int:
        """The request id of ``turn`` (1-based) of ``conversation`` (0-based): conversation-major."""
        return conversation * self.num_turns + turn - 1

    def start_times(self, request_rate: float, burstiness: float = 1.0) -> list[float]:
        """When each conversation sends its first turn, seconds after the run's start."""
        return arrival_times(self.num_conversations, request_rate, burstiness, self.seed)

    def user_message(self, builder: PromptBuilder, conversation: int, turn: int) -> str:
        """The user's message of ``turn`` of ``conversation``: exactly ``user_len`` tokens."""
        return builder.text(self.user_len, key=self.rid(conversation, turn))


@dataclass(frozen=True)
class Turn:
    """One turn as sent: its conversation (0-based), turn number (1-based), the messages sent and the record."""

    conversation: int
    turn: int
    messages: tuple[dict[str, str], ...]
    record: RequestRecord


class ConversationRunner:
    """Runs a :class:`MultiTurnDataset` through a :class:`LoadGenerator` (its client configuration, the
    bound on requests in flight, each request's deadline and the run's bound).

    A turn that fails ends its conversation: its later turns are recorded as not sent. ``tokenizer``
    builds the user messages and counts each turn's templated prompt (the request's ``prompt_len``;
    the metrics use the server's own count where it reports one).
    """

    def __init__(self, generator: LoadGenerator, dataset: MultiTurnDataset, tokenizer: Tokenizer) -> None:
        self._generator = generator
        self._dataset = dataset
        self._tokenizer = tokenizer
        self._builder = PromptBuilder(tokenizer, seed=dataset.seed)

    def run_sync(self, request_rate: float, burstiness: float = 1.0) -> list[Turn]:
        return asyncio.run(self.run(request_rate, burstiness))

    async def run(self, request_rate: float, burstiness: float = 1.0) -> list[Turn]:
        """Every turn of every conversation, in request-id order (conversation-major). Never raises for
        a request's failure; returns by the run's bound plus a short grace."""
        data = self._dataset
        users = [[data.user_message(self._builder, c, t) for t in range(1, data.num_turns + 1)] for c in range(
            data.num_conversations
        )]  # fmt: skip
        starts = data.start_times(request_rate, burstiness)
        async with self._generator.session() as client:
            slots = self._generator.slots()
            start = time.perf_counter()
            talks = [
                self._conversation(client, c, users[c], starts[c], start, slots) for c in range(data.num_conversations)
            ]
            done = await asyncio.gather(*talks)
        return [turn for conversation in done for turn in conversation]

    async def _conversation(
        self,
        client: httpx.AsyncClient,
        conversation: int,
        users: list[str],
        first_s: float,
        start: float,
        slots: asyncio.Semaphore | None,
    ) -> list[Turn]:
        """One conversation's turns in order, each after the previous answer (and the think time)."""
        data = self._dataset
        history: list[dict[str, str]] = []
        turns: list[Turn] = []
        ready_s = first_s
        for number, text in enumerate(users, start=1):
            messages = (*history, {"role": "user", "content": text})
            request = Request(data.rid(conversation, number), ready_s, self._prompt_len(messages), data.output_len)
            if turns and not turns[-1].record.ok:
                why = f"turn {number - 1} failed ({turns[-1].record.status.value})"
                turns.append(Turn(conversation, number, messages, RequestRecord(request, Status.NOT_SENT, error=why)))
                continue
            record = await self._generator.submit(client, request, Chat(messages), start, slots)
            turns.append(Turn(conversation, number, messages, record))
            history = [*messages, {"role": "assistant", "content": record.text}]
            ready_s = time.perf_counter() - start + data.think_time_s
        return turns

    def _prompt_len(self, messages: tuple[dict[str, str], ...]) -> int:
        """Tokens of the templated chat (the messages' own tokens where the model has no template)."""
        if self._tokenizer.chat_template is not None:
            return len(self._tokenizer.apply_chat_template(list(messages)))
        return max(1, sum(len(self._tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages))


@dataclass(frozen=True)
class TurnSummary:
    """TTFT over the completed requests of one turn number (or of every turn after the first: ``turn`` 0)."""

    turn: int
    requests: int
    completed: int
    mean_input_tokens: float | None
    ttft_s: Summary

    @classmethod
    def of(cls, turn: int, turns: list[Turn]) -> TurnSummary:
        done = [t.record for t in turns if t.record.ok]
        mean_input = sum(r.input_tokens for r in done) / len(done) if done else None
        return cls(turn, len(turns), len(done), mean_input, Summary.of(r.ttft_s for r in done if r.ttft_s is not None))

    def to_json(self) -> dict:
        out = {
            "turn": self.turn,
            "requests": self.requests,
            "completed": self.completed,
            "mean_input_tokens": self.mean_input_tokens,
        }
        for stat in ("mean", "median", "p90", "p99"):
            value = getattr(self.ttft_s, stat)
            out[f"{stat}_ttft_ms"] = None if value is None else value * 1000
        return out


def per_turn(turns: list[Turn]) -> list[TurnSummary]:
    """One summary per turn number, in order."""
    numbers = sorted({t.turn for t in turns})
    return [TurnSummary.of(n, [t for t in turns if t.turn == n]) for n in numbers]


def later_turns(turns: list[Turn]) -> TurnSummary:
    """The summary of every turn after the first (``turn`` 0): the turns a prefix cache serves."""
    return TurnSummary.of(0, [t for t in turns if t.turn > 1])


def turn_report(turns: list[Turn]) -> str:
    """A text block: TTFT p50 per turn and of the later turns against turn 1, in milliseconds."""
    width = 50
    lines = [f"{'TTFT by turn':-^{width}}"]
    summaries = per_turn(turns)
    for s in summaries:
        median = "-" if s.ttft_s.median is None else f"{s.ttft_s.median * 1000:.2f}"
        lines.append(f"{f'Turn {s.turn} median TTFT (ms, {s.completed}/{s.requests}):':<40} {median:<10}")
    later = later_turns(turns)
    first = summaries[0].ttft_s.median if summaries else None
    if later.ttft_s.median is not None:
        lines.append(f"{'Later turns median TTFT (ms):':<40} {later.ttft_s.median * 1000:<10.2f}")
        if first:
            lines.append(f"{'Later turns / turn 1 (median TTFT):':<40} {later.ttft_s.median / first:<10.2f}")
    return "\n".join(lines)
