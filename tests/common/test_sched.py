"""The scheduling policy and the block book (dejavu_common.sched): pure logic, checked against a fake KV store
that records which token each block position holds, so every slice is verified to read its own tokens."""

from __future__ import annotations

import random

import pytest

from dejavu_common.sched import (
    FREED,
    BlockBook,
    Budget,
    OutOfBlocks,
    RequestState,
    RequestTooLong,
    Scheduler,
    Status,
    most_blocks,
)
from dejavu_common.sched.state import IllegalTransition

BS = 4


def _req(rid: str, prompt: list[int], max_tokens: int = 4, extra: bytes = b"") -> RequestState:
    return RequestState(rid, list(prompt), len(prompt), max_tokens, extra_key=extra)


class FakeModel:
    """Stands in for the stages: writes each computed position's token id into its block, checks that each slice
    attends over exactly its request's tokens (with a sliding ``window``, those of its first query's window on, read
    from blocks it references, never a FREED entry), and samples a token that depends on every id before it.
    ``held[rid]``: the most blocks a request's table named at once."""

    def __init__(self, book: BlockBook, vocab: int = 50, window: int | None = None) -> None:
        self.kv: dict[tuple[int, int], int] = {}
        self.book = book
        self.vocab = vocab
        self.window = window
        self.held: dict[str, int] = {}

    def run(self, sched: Scheduler, done) -> dict[str, int]:
        sampled = {}
        for s in done.slices:
            r = s.request
            end = s.start + s.length
            assert len(s.table) * BS >= end
            live = [b for b in s.table if b != FREED]
            assert s.table[len(s.table) - len(live) :] == tuple(live), "freed entries lead the table"
            assert all(self.book.ref(b) > 0 for b in live), f"{r.request_id} names a block it does not reference"
            self.held[r.request_id] = max(self.held.get(r.request_id, 0), len(live))
            for p in range(s.start, end):
                self.kv[(s.table[p // BS], p % BS)] = r.token_ids[p]
            first = 0 if self.window is None else max(0, s.start - self.window + 1)
            assert FREED not in s.table[first // BS : -(-end // BS)], f"{r.request_id} reads a freed block"
            seen = [self.kv.get((s.table[p // BS], p % BS)) for p in range(first, end)]
            assert seen == r.token_ids[first:end], f"{r.request_id} attends over the wrong KV"
            if s.samples:
                sampled[r.request_id] = hash(tuple(r.token_ids)) % self.vocab
        return sampled


def _drain(sched: Scheduler, model: FakeModel, max_passes: int = 10_000) -> list:
    passes = []
    for _ in range(max_passes):
        if not len(sched):
            return passes
        step = sched.schedule()
        assert step, "a pass with nothing in it while requests wait: the policy is stuck"
        passes.append(step)
        sched.update(step, model.run(sched, step))
    raise AssertionError("did not finish")


# -- the book ---------------------------------------------------------------------------------------


def test_blocks_are_referenced_shared_and_returned_tail_first() -> None:
    book = BlockBook(4, BS)
    table = book.allocate(3)
    assert book.free == 1 and all(book.ref(b) == 1 for b in table)
    book.share(table[:2])
    assert book.ref(table[0]) == 2 and book.stats().shared == 2
    book.release(table)
    assert book.free == 2  # the shared two are still referenced
    with pytest.raises(OutOfBlocks):
        book.allocate(3)
    book.release(table[:2])
    assert book.free == 4
    with pytest.raises(ValueError, match="more often"):
        book.release(table[:1])


def test_a_block_hits_only_once_committed_and_is_evicted_least_recently_used() -> None:
    book = BlockBook(3, BS)
    ids = list(range(12))
    hashes = book.hashes(ids)
    table = book.allocate(3)
    assert book.cached_prefix(hashes, 3) == []  # scheduled, not yet written
    for b, h in zip(table, hashes, strict=True):
        book.commit(b, h)
    assert book.cached_prefix(hashes, 3) == table
    assert book.cached_prefix(hashes, 2) == table[:2]  # capped
    book.release(table)  # tail first: the last block is the first evicted
    assert book.stats().cached_free == 3
    (fresh,) = book.allocate(1)
    assert fresh == table[2]
    assert book.cached_prefix(hashes, 3) == table[:2]  # the chain stops at the evicted block
    book.attach(table[:2])
    assert book.free == 0 and book.ref(table[0]) == 1


def test_the_chain_depends_on_the_prefix_namespace_and_extra_key() -> None:
    a, b = BlockBook(1, BS, namespace=b"m1"), BlockBook(1, BS, namespace=b"m2")
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert a.hashes(ids) != b.hashes(ids)
    assert a.hashes(ids) != a.hashes(ids, extra_key=b"salt")
    assert a.hashes([9, 9, 9, 9, *ids[4:]])[1] != a.hashes(ids)[1]  # same block, other prefix
    assert a.hashes(ids[:7]) == a.hashes(ids)[:1]  # a partial block has no hash


def test_caching_off_never_hits() -> None:
    book = BlockBook(2, BS, caching=False)
    hashes = book.hashes([1, 2, 3, 4])
    (b,) = book.allocate(1)
    book.commit(b, hashes[0])
    assert book.cached_prefix(hashes, 1) == []


# -- the policy -------------------------------------------------------------------------------------


def test_a_long_prompt_is_chunked_on_block_boundaries_while_running_requests_decode() -> None:
    book = BlockBook(200, BS)
    sched = Scheduler(book, Budget(tokens=10, max_running=8))
    model = FakeModel(book)
    sched.add(_req("short", [1, 2, 3], max_tokens=30))
    first = sched.schedule()
    sched.update(first, model.run(sched, first))
    sched.add(_req("long", list(range(100, 150)), max_tokens=3))
    passes = _drain(sched, model)
    for step in passes:
        assert step.tokens <= 10
        long = [s for s in step.slices if s.request.request_id == "long"]
        if long and not long[0].samples:
            assert (long[0].start + long[0].length) % BS == 0  # a chunk that is not the prompt's last ends on a block
    # Every pass while "short" was still running gave it a token: the long prompt never stalled it.
    short_passes = [step for step in passes if any(s.request.request_id == "short" for s in step.slices)]
    assert len(short_passes) == 29
    assert book.free == 200


def test_a_short_request_beside_a_long_prompt_gets_all_its_tokens() -> None:
    """No padding: each request has its own positions, so a short one is never cut short by a long neighbour."""
    book = BlockBook(600, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=4))
    model = FakeModel(book)
    long, short = _req("long", [7] * 1800, max_tokens=5), _req("short", [1] * 10, max_tokens=600)
    sched.add(long)
    sched.add(short)
    _drain(sched, model)
    assert short.generated == 600 and long.generated == 5
    assert short.status is Status.FINISHED and book.free == 600


def test_pipeline_passes_in_flight_never_hold_a_request_twice_and_decodes_are_balanced() -> None:
    book = BlockBook(100, BS)
    sched = Scheduler(book, Budget(tokens=100, max_running=6, depth=3))
    model = FakeModel(book)
    for i in range(6):
        sched.add(_req(f"r{i}", [i + 1, 2], max_tokens=10))
    in_flight = [sched.schedule() for _ in range(3)]
    ids = [s.request.request_id for step in in_flight for s in step.slices]
    assert len(ids) == len(set(ids)) == 6
    for step in in_flight:
        sched.update(step, model.run(sched, step))
    decode_passes = [sched.schedule() for _ in range(3)]
    assert [len(step.slices) for step in decode_passes] == [2, 2, 2]  # ceil(6 / 3) decodes each


def test_a_short_pool_preempts_the_newest_which_resumes_on_its_cached_blocks_with_the_same_tokens() -> None:
    def run(blocks: int) -> tuple[dict[str, list[int]], int]:
        book = BlockBook(blocks, BS)
        sched = Scheduler(book, Budget(tokens=64, max_running=4))
        model = FakeModel(book)
        reqs = [_req(f"r{i}", [i + 1] * 9, max_tokens=24) for i in range(4)]
        for r in reqs:
            sched.add(r)
        passes = _drain(sched, model)
        assert book.free == blocks
        return {r.request_id: r.token_ids for r in reqs}, sum(len(p.preempted) for p in passes)

    roomy, none = run(100)
    tight, preemptions = run(20)  # 4 requests of 33 positions need 36 blocks: some must wait their turn
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_a_shared_prefix_is_computed_once_and_multi_turn_history_hits() -> None:
    book = BlockBook(100, BS)
    sched = Scheduler(book, Budget(tokens=256, max_running=8))
    model = FakeModel(book)
    system = list(range(40, 60))  # 5 full blocks
    first = _req("a", [*system, 1, 2], max_tokens=6)
    sched.add(first)
    _drain(sched, model)
    second = _req("b", [*system, 3, 4, 5], max_tokens=2)
    sched.add(second)
    step = sched.schedule()
    assert step.slices[0].start == 20 and second.cached_tokens == 20  # only the suffix is computed
    sched.update(step, model.run(sched, step))
    _drain(sched, model)
    # The next turn re-sends the first conversation's history (prompt and reply) plus a new message.
    history = [*first.token_ids, 9, 9, 9]
    turn = _req("a2", history, max_tokens=1)
    sched.add(turn)
    step = sched.schedule()
    assert turn.cached_tokens == (len(first.token_ids) - 1) // BS * BS > len(system)
    sched.update(step, model.run(sched, step))
    _drain(sched, model)
    salted = _req("c", [*system, 1, 2], max_tokens=1, extra=b"other-tenant")
    sched.add(salted)
    sched.schedule()
    assert salted.cached_tokens == 0
    stats = book.stats()
    assert stats.hits > 0 and stats.queries > stats.hits


def test_choices_of_one_prompt_compute_its_blocks_once() -> None:
    """n > 1: the siblings of a request queued with it wait one pass while it computes the shared blocks, then
    read them (forked by reference) and compute only their last, partial block."""
    book = BlockBook(100, BS)
    sched = Scheduler(book, Budget(tokens=256, max_running=8))
    model = FakeModel(book)
    prompt = list(range(100, 122))  # 5 full blocks and 2 tokens
    for i in range(4):
        sched.add(_req(f"n{i}", prompt, max_tokens=3))
    first = sched.schedule()
    assert [(s.request.request_id, s.start, s.length) for s in first.slices] == [("n0", 0, 22)]
    sched.update(first, model.run(sched, first))
    second = sched.schedule()
    siblings = [(s.request.request_id, s.start, s.length) for s in second.slices if s.request.request_id != "n0"]
    assert siblings == [("n1", 20, 2), ("n2", 20, 2), ("n3", 20, 2)]
    shared = second.slices[1].table[:5]
    assert all(s.table[:5] == shared for s in second.slices) and book.ref(shared[0]) == 4
    sched.update(second, model.run(sched, second))
    _drain(sched, model)
    assert book.stats().hits == 3 * 20 and book.free == 100


def test_a_full_hit_still_computes_the_last_prompt_token() -> None:
    book = BlockBook(10, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=2))
    model = FakeModel(book)
    prompt = list(range(8))  # exactly two blocks
    sched.add(_req("a", prompt, max_tokens=1))
    _drain(sched, model)
    again = _req("b", prompt, max_tokens=1)
    sched.add(again)
    step = sched.schedule()
    assert step.slices[0].start == 4 and step.slices[0].length == 4 and step.slices[0].samples


def test_disaggregated_intake_reserves_blocks_and_sends_only_what_is_missing() -> None:
    book = BlockBook(12, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=3))
    model = FakeModel(book)
    prompt = list(range(10))
    first = _req("a", prompt, max_tokens=2)
    assert sched.reserve(first) and first.status is Status.ARRIVING and first.cached_tokens == 0
    assert not sched.schedule()  # its KV is still arriving
    for p in range(10):  # the stream lands
        model.kv[(first.table[p // BS], p % BS)] = prompt[p]
    sched.arrived(first, 77)
    _drain(sched, model)
    second = _req("b", prompt, max_tokens=2)
    assert sched.reserve(second) and second.cached_tokens == 8  # two blocks need not travel
    big = _req("c", list(range(100, 140)), max_tokens=2)
    assert not sched.reserve(big) and big.table == [] and book.free == 12 - 3  # no room now: nothing taken


def test_finishing_a_request_in_flight_frees_its_blocks_when_its_pass_returns() -> None:
    book = BlockBook(10, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=2))
    model = FakeModel(book)
    sched.add(_req("a", [1, 2, 3, 4, 5], max_tokens=9))
    step = sched.schedule()
    sched.finish("a")
    assert book.free == 8  # its pass is still writing its blocks
    sched.update(step, model.run(sched, step))
    assert book.free == 10 and not len(sched)
    with pytest.raises(IllegalTransition):
        sched.add(_req("b", [1], max_tokens=1)) or sched.get("b").move(Status.PREEMPTED)


def test_max_tokens_zero_computes_the_prompt_only() -> None:
    book = BlockBook(10, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=2))
    r = _req("echo", [1, 2, 3], max_tokens=0)
    sched.add(r)
    _drain(sched, FakeModel(book))
    assert r.token_ids == [1, 2, 3] and r.status is Status.FINISHED


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_gives_the_same_tokens_with_caching_on_or_off_and_returns_every_block(seed: int) -> None:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 30))] for _ in range(3)]
    specs = [
        (rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 25))], rng.randrange(0, 20))
        for _ in range(rng.randrange(5, 25))
    ]
    blocks = rng.randrange(16, 80)
    budget = Budget(tokens=rng.randrange(4, 40), max_running=rng.randrange(1, 8), depth=rng.randrange(1, 4))

    def run(caching: bool) -> list[list[int]]:
        book = BlockBook(blocks, BS, caching=caching)
        sched = Scheduler(book, budget)
        model = FakeModel(book)
        reqs = [_req(f"r{i}", p, m) for i, (p, m) in enumerate(specs)]
        in_flight: list = []
        arrivals = iter(reqs)
        for r in arrivals:  # arrivals interleave with passes, several passes in flight
            sched.add(r)
            if rng.random() < 0.5:
                step = sched.schedule()
                if step:
                    in_flight.append(step)
            while len(in_flight) >= budget.depth or (in_flight and rng.random() < 0.3):
                done = in_flight.pop(0)
                sched.update(done, model.run(sched, done))
        for done in in_flight:
            sched.update(done, model.run(sched, done))
        _drain(sched, model)
        assert book.free == blocks and book.stats().used == 0
        return [r.token_ids for r in reqs]

    assert run(caching=True) == run(caching=False)


def test_a_request_the_whole_pool_could_not_hold_is_refused_at_intake() -> None:
    sched = Scheduler(BlockBook(4, BS), Budget(tokens=64, max_running=2))
    with pytest.raises(RequestTooLong, match="holds 16"):
        sched.add(_req("big", [1] * 10, max_tokens=7))
    with pytest.raises(RequestTooLong):
        sched.reserve(_req("big2", [1] * 17, max_tokens=0))
    sched.add(_req("fits", [1] * 10, max_tokens=6))
    _drain(sched, FakeModel(sched.book))


# -- sliding windows --------------------------------------------------------------------------------

WINDOW = 6  # positions: a query at i reads keys i - 5 .. i


def test_most_blocks_counts_the_window_and_a_pass_not_the_whole_request() -> None:
    assert most_blocks(1000, BS) == 250
    assert most_blocks(1000, BS, WINDOW, chunk=1) == 3  # ceil(6 / 4) + 1: a decode's window and its block
    assert most_blocks(1000, BS, WINDOW, chunk=8) == 5  # 5 positions before an 8-token chunk, straddling blocks
    assert most_blocks(7, BS, WINDOW, chunk=8) == 2  # never more than the whole request
    assert most_blocks(1000, BS, WINDOW) == 250  # whole prompts (no chunk) hold them all while they run


def test_a_long_generation_under_a_window_holds_only_the_window_and_gives_the_same_tokens() -> None:
    def run(window: int | None) -> tuple[list[int], FakeModel, BlockBook]:
        book = BlockBook(200, BS)
        sched = Scheduler(book, Budget(tokens=8, max_running=2), window)
        model = FakeModel(book, window=window)
        r = _req("long", list(range(1, 23)), max_tokens=150)  # a prompt of 22 over 3 chunks, then 150 tokens
        sched.add(r)
        while len(sched):
            step = sched.schedule()
            sched.update(step, model.run(sched, step))
            gone = 0 if window is None or not len(sched) else max(0, (r.computed - window + 1) // BS)
            assert r.table[:gone] == [FREED] * gone and FREED not in r.table[gone:]
            assert book.stats().used == len(r.table) - gone  # the book holds what its table names, no more
        assert book.free == 200 and book.stats().used == 0
        return r.token_ids, model, book

    plain, whole, _ = run(None)
    windowed, model, book = run(WINDOW)
    assert windowed == plain
    assert whole.held["long"] == 172 // BS  # without a window: every block to the end
    assert model.held["long"] <= most_blocks(172, BS, WINDOW, chunk=8) == 5
    assert book.stats().cached_free == (172 - 1) // BS  # every full block it gave back is still cached


def test_blocks_out_of_the_window_go_back_to_the_book_as_the_request_advances() -> None:
    book = BlockBook(50, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=1), WINDOW)
    model = FakeModel(book, window=WINDOW)
    r = _req("a", list(range(1, 11)), max_tokens=20)  # 10 positions: the next query (10) reads 5..10
    sched.add(r)
    step = sched.schedule()
    table = list(step.slices[0].table)
    sched.update(step, model.run(sched, step))
    assert r.table == [FREED, table[1], table[2]]  # block 0 (positions 0..3) went back
    assert book.ref(table[0]) == 0 and book.hash_of(table[0]) is not None  # free, its prefix still cached
    assert book.free == 50 - 2
    for _ in range(6):  # to position 16: the next query reads 11..16, blocks 2.. stay
        step = sched.schedule()
        sched.update(step, model.run(sched, step))
    assert r.computed == 16 and r.table[:2] == [FREED, FREED] and FREED not in r.table[2:]
    sched.finish("a")
    assert book.free == 50


def test_a_prefix_hit_under_a_window_references_only_the_hits_inside_its_window() -> None:
    book = BlockBook(50, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=2), WINDOW)
    model = FakeModel(book, window=WINDOW)
    prompt = list(range(1, 23))  # 5 full blocks and 2 tokens
    sched.add(_req("a", prompt, max_tokens=3))
    _drain(sched, model)
    assert book.free == 50
    b = _req("b", [*prompt, 40], max_tokens=3)
    sched.add(b)
    step = sched.schedule()
    (piece,) = step.slices
    assert piece.start == 20 and b.cached_tokens == 20  # five blocks hit; its first query (20) reads 15..20
    assert piece.table[:3] == (FREED, FREED, FREED) and FREED not in piece.table[3:]
    assert [book.ref(x) for x in piece.table[3:5]] == [1, 1]  # the window's two hits are referenced, the rest free
    assert book.free == 50 - 3
    sched.update(step, model.run(sched, step))
    _drain(sched, model)
    assert book.free == 50 and b.generated == 3


def test_a_pool_too_small_for_a_request_without_a_window_serves_it_under_one() -> None:
    long = [1] * 30
    with pytest.raises(RequestTooLong, match="holds 32"):
        Scheduler(BlockBook(8, BS), Budget(tokens=4, max_running=1)).add(_req("a", long, max_tokens=100))
    sched = Scheduler(BlockBook(8, BS), Budget(tokens=4, max_running=1), WINDOW)
    with pytest.raises(RequestTooLong, match="10 blocks at once under its sliding window"):
        Scheduler(BlockBook(8, BS), Budget(tokens=30, max_running=1), WINDOW).add(_req("b", long, max_tokens=100))
    r = _req("a", long, max_tokens=100)
    sched.add(r)
    model = FakeModel(sched.book, window=WINDOW)
    _drain(sched, model)
    assert r.generated == 100 and model.held["a"] <= 4 and sched.book.free == 8


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_under_a_window_gives_the_same_tokens_in_a_tight_pool_and_returns_every_block(
    seed: int,
) -> None:
    """Preemptions, prefix hits (attached inside the window only), evictions of cached blocks given back by the
    window, chunked prompts and several passes in flight: the same tokens as without a window in a roomy pool."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 30))] for _ in range(3)]
    specs = [
        (rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 25))], rng.randrange(0, 60))
        for _ in range(rng.randrange(5, 25))
    ]
    budget = Budget(tokens=rng.randrange(4, 12), max_running=rng.randrange(1, 8), depth=rng.randrange(1, 4))

    def run(blocks: int, window: int | None, caching: bool) -> tuple[list[list[int]], int]:  # tokens, preemptions
        book = BlockBook(blocks, BS, caching=caching)
        sched = Scheduler(book, budget, window)
        model = FakeModel(book, window=window)
        reqs = [_req(f"r{i}", p, m) for i, (p, m) in enumerate(specs)]
        in_flight: list = []
        preempted = 0
        for r in reqs:
            sched.add(r)
            if rng.random() < 0.5:
                step = sched.schedule()
                preempted += len(step.preempted)
                if step:
                    in_flight.append(step)
            while len(in_flight) >= budget.depth or (in_flight and rng.random() < 0.3):
                done = in_flight.pop(0)
                sched.update(done, model.run(sched, done))
        for done in in_flight:
            sched.update(done, model.run(sched, done))
        preempted += sum(len(step.preempted) for step in _drain(sched, model))
        assert book.free == blocks and book.stats().used == 0
        if window is not None:
            longest = max(len(p) + m for p, m in specs)
            assert max(model.held.values()) <= most_blocks(longest, BS, window, budget.tokens)
        return [r.token_ids for r in reqs], preempted

    roomy, _ = run(400, None, True)
    assert run(400, WINDOW, True)[0] == roomy
    assert run(400, WINDOW, False)[0] == roomy
    tight, _ = run(most_blocks(100, BS, WINDOW, budget.tokens) + 2, WINDOW, True)
    assert tight == roomy


def test_disaggregated_intake_under_a_window_reserves_the_whole_prompt_and_gives_back_what_falls_out() -> None:
    book = BlockBook(12, BS)
    sched = Scheduler(book, Budget(tokens=4, max_running=2), WINDOW)
    with pytest.raises(RequestTooLong, match="holds 48"):  # its prompt streams in whole: 13 blocks
        sched.reserve(_req("big", [1] * 48, max_tokens=2))
    r = _req("a", list(range(1, 21)), max_tokens=30)
    assert sched.reserve(r) and len(r.table) == 6 and book.free == 6
    model = FakeModel(book, window=WINDOW)
    for p in range(20):  # the stream lands
        model.kv[(r.table[p // BS], p % BS)] = r.token_ids[p]
    sched.arrived(r, 7)
    assert book.free == 6 and FREED not in r.table  # its blocks enter the cache once its first pass returns
    step = sched.schedule()
    sched.update(step, model.run(sched, step))
    assert r.table[:3] == [FREED] * 3  # the next query (21) reads 16..21
    _drain(sched, model)
    assert r.generated == 30 and book.free == 12


def test_a_streamed_prompt_enters_the_prefix_cache_only_once_its_first_pass_returned() -> None:
    """Its prompt KV reached stage 0 but the other stages write theirs only in its first pass: a pass that never
    returns (it failed there) leaves nothing another request could hit."""
    book = BlockBook(12, BS)
    sched = Scheduler(book, Budget(tokens=64, max_running=3))
    prompt = list(range(10))
    r = _req("a", prompt, max_tokens=4)
    assert sched.reserve(r)
    sched.arrived(r, 77)
    assert book.cached_prefix(book.hashes(prompt), 2) == []
    step = sched.schedule()
    sched.abandon(step)
    sched.finish("a")
    again = _req("b", prompt, max_tokens=4)
    assert sched.reserve(again) and again.cached_tokens == 0  # nothing cached to hit
    sched.arrived(again, 77)
    sched.update(sched.schedule(), {"b": 5})
    assert len(book.cached_prefix(book.hashes(prompt), 2)) == 2  # its first pass returned: both full blocks


def test_a_new_book_takes_running_requests_over_in_their_blocks_and_ends_with_the_same_tokens() -> None:
    """Stage 0 lost mid-answer: a new book adopts each running request in the blocks its table names (two of them
    sharing a prefix block), from a position every stage holds, and the answers equal an uninterrupted run's; every
    block returns. A table that cannot be the request's is refused with nothing referenced."""

    def requests() -> list[RequestState]:
        return [_req("a", [5] * 9 + [1], max_tokens=12), _req("b", [5] * 9 + [2], max_tokens=12)]

    def scheduler(book: BlockBook) -> Scheduler:
        return Scheduler(book, Budget(tokens=64, max_running=4))

    book = BlockBook(40, BS)
    sched, model = scheduler(book), FakeModel(book)
    whole = requests()
    for r in whole:
        sched.add(r)
    _drain(sched, model)

    book = BlockBook(40, BS)
    sched, model = scheduler(book), FakeModel(book)
    lost = requests()
    sched.add(lost[0])
    for _ in range(3):  # "a" is computed and cached, then "b" hits its first two blocks
        step = sched.schedule()
        sched.update(step, model.run(sched, step))
    sched.add(lost[1])
    for _ in range(4):
        step = sched.schedule()
        sched.update(step, model.run(sched, step))
    assert lost[0].table[:2] == lost[1].table[:2]
    held = {r.request_id: (tuple(r.table), r.computed, list(r.token_ids)) for r in lost}

    book = BlockBook(40, BS)  # the new stage 0: its pool's KV is what the other stages and the restore hold
    sched = scheduler(book)
    model.book = book
    taken = []
    for rid, (table, computed, tokens) in held.items():
        state = RequestState(rid, tokens, 10, 12)
        sched.adopt(state, table, computed - 2)  # from a position every stage holds: the rest is computed again
        taken.append(state)
    assert book.ref(taken[0].table[0]) == 2  # the shared prefix block, referenced by both
    _drain(sched, model)
    assert [r.token_ids for r in taken] == [r.token_ids for r in whole]
    assert book.free == 40

    with pytest.raises(ValueError, match="does not hold"):
        sched.adopt(RequestState("c", [1] * 9, 9, 4), (0, 1), 9)
    with pytest.raises(ValueError, match="not all of a pool"):
        sched.adopt(RequestState("d", [1] * 9, 9, 4), (0, 1, 99), 9)
    assert book.free == 40
