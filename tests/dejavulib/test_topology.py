"""The pure planner: every (layer, request, position) of a round moves exactly once, to the right place."""

from __future__ import annotations

import itertools

import pytest

from dejavulib.topology import Topology, plan_transfers, right_aligned, token_padded_lengths

CASES = [
    # (src depth, src microbatch, dst depth, dst microbatch, padded lengths of the prompt microbatches)
    (1, 4, 2, 4, [7]),
    (2, 4, 3, 8, [5, 9]),
    (2, 8, 3, 4, [6]),
    (3, 2, 2, 3, [3, 4, 5]),
]


def _cells(transfers, src: Topology, dst: Topology):
    """(dst stage, dst mb, dst row, layer, dst position) -> (src stage, src mb, src row, src position)."""
    cells = {}
    for t in transfers:
        assert src.stage_layer_ranges[t.src_stage][0] <= t.layers[0] < t.layers[1]
        assert t.layers[1] <= src.stage_layer_ranges[t.src_stage][1]
        assert dst.stage_layer_ranges[t.dst_stage][0] <= t.layers[0]
        assert t.layers[1] <= dst.stage_layer_ranges[t.dst_stage][1]
        for r, layer, p in itertools.product(range(t.n_rows), range(*t.layers), range(*t.positions)):
            key = (t.dst_stage, t.dst_microbatch, t.dst_rows[0] + r, layer, p + t.dst_position_offset)
            assert key not in cells, f"{key} written twice"
            cells[key] = (t.src_stage, t.src_microbatch, t.src_rows[0] + r, p)
    return cells


@pytest.mark.parametrize(("dp", "mp", "dt", "mt", "lengths"), CASES)
def test_plan_covers_every_cell_exactly_once(dp: int, mp: int, dt: int, mt: int, lengths: list[int]) -> None:
    src, dst = Topology.even(12, dp, mp), Topology.even(12, dt, mt)
    cells = _cells(plan_transfers(src, dst, lengths), src, dst)
    dst_lengths = token_padded_lengths(src, dst, lengths)
    assert len(cells) == sum(12 * mp * p for p in lengths)
    for (d_stage, d_mb, d_row, layer, d_pos), (s_stage, s_mb, s_row, s_pos) in cells.items():
        request = s_mb * mp + s_row
        assert request == d_mb * mt + d_row, "a request must keep its identity"
        assert layer in range(*src.stage_layer_ranges[s_stage]) and layer in range(*dst.stage_layer_ranges[d_stage])
        assert d_pos - s_pos == dst_lengths[d_mb] - lengths[s_mb], "left padding: right-aligned"


def test_merge_two_prompt_microbatches_into_one_token_microbatch() -> None:
    src, dst = Topology.even(30, 2, 4), Topology.even(30, 3, 8)
    transfers = plan_transfers(src, dst, [100, 80])
    into_mb0 = {(t.src_microbatch, t.dst_rows, t.dst_position_offset) for t in transfers if t.dst_microbatch == 0}
    assert into_mb0 == {(0, (0, 4), 0), (1, (4, 8), 20)}
    assert {t.layers for t in transfers if t.src_stage == 0} == {(0, 10), (10, 15)}


def test_split_one_prompt_microbatch_across_token_microbatches() -> None:
    transfers = plan_transfers(Topology.even(4, 1, 8), Topology.even(4, 1, 4), [10])
    assert sorted((t.dst_microbatch, t.src_rows, t.dst_rows) for t in transfers) == [
        (0, (0, 4), (0, 4)),
        (1, (4, 8), (0, 4)),
    ]


@pytest.mark.parametrize("ranges", [((0, 3), (4, 6)), ((1, 6),), ()])
def test_topology_rejects_gaps(ranges) -> None:
    with pytest.raises(ValueError):
        Topology(ranges, 4)


def test_layer_count_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        plan_transfers(Topology.even(4, 1, 4), Topology.even(6, 2, 4), [3])


def test_even_split_is_the_serving_systems_stage_split() -> None:
    """The library cannot import the serving packages, so the rule exists twice: they must agree, or a
    streaming plan built with ``Topology.even`` would not line up with the stages the controller places."""
    from dejavu_common.partition import split_layers

    for layers in range(1, 40):
        for depth in range(1, layers + 1):
            assert list(Topology.even(layers, depth, 1).stage_layer_ranges) == split_layers(layers, depth)


@pytest.mark.parametrize(
    ("src_padded", "length", "dst_padded", "src", "dst"),
    [
        (66, 66, 66, (0, 66), (0, 66)),
        (66, 20, 20, (46, 66), (0, 20)),  # the piece's microbatch is shorter than the task (issue 14's crash)
        (20, 20, 66, (0, 20), (46, 66)),  # longer: the piece lands right-aligned
        (66, 12, 30, (54, 66), (18, 30)),  # only the positions holding the piece's prompts move
    ],
)
def test_right_aligned_moves_only_positions_holding_prompts(src_padded, length, dst_padded, src, dst) -> None:
    got_src, got_dst = right_aligned(src_padded, length, dst_padded)
    assert (got_src, got_dst) == (src, dst)
    assert got_src[1] - got_src[0] == got_dst[1] - got_dst[0] == length


@pytest.mark.parametrize(("src_padded", "length", "dst_padded"), [(10, 11, 20), (20, 11, 10), (10, 0, 10)])
def test_right_aligned_refuses_prompts_that_do_not_fit(src_padded, length, dst_padded) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        right_aligned(src_padded, length, dst_padded)
