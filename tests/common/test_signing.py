"""Signed token-stream entries (dejavu_common.signing): only the writer's own key makes a valid entry, for
that stream, that writer and that content."""

from __future__ import annotations

import base64

import pytest

from dejavu_common.signing import (
    EntrySigner,
    UnverifiedEntry,
    public_key,
    seal,
    sign_watermark,
    token_entry,
    unseal,
    verify_entry,
    verify_watermark,
)

STREAM, OTHER = "dejavu:tok:7", "dejavu:tok:8"


def _fields(entry: dict[str, bytes]) -> dict[bytes, bytes]:
    """``entry`` as Redis hands it back: field names and values as bytes."""
    return {k.encode(): v for k, v in entry.items()}


@pytest.fixture
def workers() -> tuple[EntrySigner, EntrySigner, dict]:
    a, b = EntrySigner("t-a"), EntrySigner("t-b")
    return a, b, {"t-a": (public_key(a.public_key),), "t-b": (public_key(b.public_key),)}


def test_an_entry_verifies_under_its_writers_key(workers) -> None:
    a, _, keys_of = workers
    fields = _fields(token_entry(a, STREAM, b'{"step": 1}'))
    assert verify_entry(STREAM, fields, "step", keys_of) == ("t-a", b'{"step": 1}')


def test_an_entry_of_a_claiming_to_be_b_is_refused(workers) -> None:
    a, _, keys_of = workers
    fields = _fields(a.entry(STREAM, "step", b"text"))
    fields[b"by"] = b"t-b"  # a's signature, b's name
    with pytest.raises(UnverifiedEntry, match="does not verify"):
        verify_entry(STREAM, fields, "step", keys_of)
    impostor = EntrySigner("t-b")  # a key of a's own making, under b's id
    with pytest.raises(UnverifiedEntry, match="does not verify"):
        verify_entry(STREAM, _fields(impostor.entry(STREAM, "step", b"text")), "step", keys_of)


@pytest.mark.parametrize("change", ["payload", "stream", "signature"])
def test_a_changed_or_moved_entry_is_refused(workers, change: str) -> None:
    a, _, keys_of = workers
    fields = _fields(a.entry(STREAM, "step", b"tokens 1 2 3"))
    stream = STREAM
    if change == "payload":
        fields[b"step"] = b"tokens 6 6 6"
    elif change == "stream":
        stream = OTHER  # a valid entry of stream 7 copied into stream 8
    else:
        raw = bytearray(base64.b64decode(fields[b"sig"]))
        raw[0] ^= 1
        fields[b"sig"] = base64.b64encode(bytes(raw))
    with pytest.raises(UnverifiedEntry, match="does not verify"):
        verify_entry(stream, fields, "step", keys_of)


def test_a_writer_the_reader_does_not_accept_is_refused(workers) -> None:
    a, _, keys_of = workers
    spare = EntrySigner("t-spare")
    with pytest.raises(UnverifiedEntry, match="may not write"):
        verify_entry(STREAM, _fields(spare.entry(STREAM, "step", b"x")), "step", keys_of)
    with pytest.raises(UnverifiedEntry, match="may not write"):
        verify_entry(STREAM, _fields(a.entry(STREAM, "step", b"x")), "step", {"t-a": ()})


@pytest.mark.parametrize(
    "fields",
    [
        {b"step": b"x"},  # unsigned (token_entry without a signer)
        {b"step": b"x", b"by": b"t-a"},
        {b"step": b"x", b"by": b"t-a", b"sig": b"not base64!"},
        {b"step": b"x", b"by": b"\xff", b"sig": b"AAAA"},
        {b"step": b"x", b"by": b"t-a\x00", b"sig": b"AAAA"},
        {b"by": b"t-a", b"sig": b"AAAA"},
    ],
)
def test_a_malformed_entry_is_refused(workers, fields: dict[bytes, bytes]) -> None:
    keys_of = {**workers[2], "t-a\x00": workers[2]["t-a"]}
    with pytest.raises(UnverifiedEntry):
        verify_entry(STREAM, fields, "step", keys_of)


def test_token_entry_without_a_signer_is_the_bare_payload() -> None:
    assert token_entry(None, STREAM, b"x") == {"step": b"x"}


@pytest.mark.parametrize("encoded", ["", "not base64!", base64.b64encode(b"short").decode()])
def test_a_malformed_public_key_is_refused(encoded: str) -> None:
    with pytest.raises(ValueError):
        public_key(encoded)


def test_a_sealed_value_opens_only_for_its_key_and_writer(workers) -> None:
    a, _, keys_of = workers
    key = "dejavu:wm:progress:5:0"
    sealed = seal(a, key, b'{"done": {}}')
    assert unseal(key, sealed, keys_of) == ("t-a", b'{"done": {}}')
    with pytest.raises(UnverifiedEntry):
        unseal("dejavu:wm:progress:5:1", sealed, keys_of)  # moved to another stage's key
    with pytest.raises(UnverifiedEntry):
        unseal(key, sealed, {"t-b": keys_of["t-b"]})  # the reader accepts only b
    claimed = sealed.replace(b'"t-a"', b'"t-b"')  # a's signature under b's name
    with pytest.raises(UnverifiedEntry, match="does not verify"):
        unseal(key, claimed, keys_of)
    for raw in (b"", b"[]", b'{"payload": 1}', b'{"v": 1, "epoch": 5}'):
        with pytest.raises(UnverifiedEntry):
            unseal(key, raw, keys_of)


def test_a_watermark_verifies_for_its_field_step_and_writer_only(workers) -> None:
    a, b, keys_of = workers
    key = "dejavu:wm:1"
    signature = sign_watermark(a, key, 7, 12)
    assert verify_watermark(key, b"7", b"12", signature, keys_of) == 12
    for mb, step, sig, accepted in (
        (b"7", b"13", signature, keys_of),  # another step
        (b"8", b"12", signature, keys_of),  # another microbatch's field
        (b"7", b"12", sign_watermark(b, key, 7, 12), {"t-a": keys_of["t-a"]}),  # b is not the replica holder
        (b"7", b"12", None, keys_of),  # unsigned
        (b"7", b"12", b"t-a", keys_of),  # no signature after the writer
    ):
        with pytest.raises(UnverifiedEntry):
            verify_watermark(key, mb, step, sig, accepted)
