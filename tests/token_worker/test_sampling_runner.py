"""The last token stage samples with each row's history: penalties see the tokens the row emitted, rebuilt from
its token stream by a stage that takes over (the same tokens and log probabilities as the stage that failed)."""

from __future__ import annotations

import redis
import torch

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_engine.sampling import RowContext, process_logits

VOCAB = 32


class Spec:
    eos_token_ids = frozenset({2})


class Stage:  # what StageRunner.state and _sample ask of a stage
    num_layers = 1
    mixes = False
    spec = Spec()

    def allocate_cache(self, batch: int, max_len: int) -> None:
        return None


def logits_of(step: int) -> torch.Tensor:
    """Two rows of logits that favour token 5 strongly, then token 6, at every step."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))
    row[5], row[6] = 10.0, 9.0
    return torch.stack([row, row])


def test_a_stage_taking_over_applies_the_same_penalties(redis_url: str) -> None:
    from dejavu_token_worker.runner import StageRunner

    client = redis.Redis.from_url(redis_url)
    penalised = SamplingSpec(max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logprobs=2)
    rows = (
        RowSpec(request_id="a", prompt_ids=(3, 4), sampling=penalised),
        RowSpec(request_id="b", prompt_ids=(3, 4), sampling=SamplingSpec(max_tokens=8, temperature=0)),
    )
    mb = 41
    client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=rows, prompt_len=2, max_len=10).encode())
    first = StageRunner(Stage(), client, None, 1.0)  # type: ignore[arg-type]
    state = first.state(mb)
    entries = []
    for step in range(6):
        entry = first._sample(state, step, logits_of(step), set(), (0, 1))
        client.xadd(keys.tokens(mb), {"step": entry.encode()})
        entries.append(entry)
    penalised_tokens = [e.tokens[0] for e in entries]
    assert [e.tokens[1] for e in entries] == [5] * 6  # the plain row: the argmax every step
    assert penalised_tokens == [5, 6, 5, 6, 5, 6]  # each emission costs a token 2 then 1.5 more: they alternate
    assert all(e.logprobs[1] is None for e in entries)
    expected = process_logits(logits_of(5)[0], penalised, RowContext((3, 4), penalised_tokens[:5]))
    assert entries[5].logprobs[0].logprob == torch.log_softmax(expected, -1)[penalised_tokens[5]].item()
    # A stage taking over at step 3 (the entries of steps 3.. never reached the stream, say) rebuilds the rows'
    # histories from the stream and samples steps 3..5 exactly as the first one did.
    client.delete(keys.tokens(mb))
    for entry in entries[:3]:
        client.xadd(keys.tokens(mb), {"step": entry.encode()})
    second = StageRunner(Stage(), client, None, 1.0)  # type: ignore[arg-type]
    resumed = [second._sample(second.state(mb), step, logits_of(step), set(), (0, 1)) for step in range(3, 6)]
    assert resumed == entries[3:]
    client.close()
