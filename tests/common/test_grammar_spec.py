"""The structured-output spec on the wire: it round-trips inside a SamplingSpec, and inconsistent specs are refused."""

from __future__ import annotations

import pydantic
import pytest

from dejavu_common.messages import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec, SamplingSpec


def test_a_grammar_round_trips_and_makes_the_spec_process_logits() -> None:
    spec = SamplingSpec(max_tokens=4, temperature=0, grammar=GrammarSpec(kind=GrammarKind.CHOICE, choices=("a", "b")))
    assert SamplingSpec.decode(spec.encode()) == spec
    assert spec.processes_logits and not spec.plain_greedy  # a constrained greedy row is not a bare argmax
    assert hash(spec.grammar) == hash(GrammarSpec(kind=GrammarKind.CHOICE, choices=("a", "b")))
    assert spec.for_choice(1).grammar == spec.grammar


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "json_schema"},
        {"kind": "regex", "source": ""},
        {"kind": "json_object", "source": "{}"},
        {"kind": "choice"},
        {"kind": "choice", "choices": ("a", "")},
        {"kind": "regex", "source": "a", "choices": ("a",)},
        {"kind": "regex", "source": "a" * (MAX_GRAMMAR_CHARS + 1)},
        {"kind": "ebnf", "source": "root ::= 'a'"},
    ],
)
def test_inconsistent_grammars_are_refused(fields: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        GrammarSpec.model_validate(fields)
