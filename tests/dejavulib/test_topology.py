"""The pure placement: every (layer, row, prompt position) of a prompt batch moves exactly once, to the right place."""

from __future__ import annotations

import itertools

import pytest

from dejavulib.topology import Piece, plan_pieces, right_aligned

TOKEN_STAGES = [(0, 4), (4, 9), (9, 12)]


def _cells(transfers, pieces: list[Piece], src_layers, dst_stages):
    """(dst stage, dst mb, dst row, layer, dst position) -> (src row, src position)."""
    cells = {}
    for t in transfers:
        assert src_layers[0] <= t.layers[0] < t.layers[1] <= src_layers[1]
        assert dst_stages[t.dst_stage][0] <= t.layers[0] and t.layers[1] <= dst_stages[t.dst_stage][1]
        for r, layer, p in itertools.product(range(t.n_rows), range(*t.layers), range(*t.positions)):
            key = (t.dst_stage, t.dst_microbatch, t.dst_rows[0] + r, layer, p + t.dst_position_offset)
            assert key not in cells, f"{key} written twice"
            cells[key] = (t.src_rows[0] + r, p)
    return cells


@pytest.mark.parametrize("src_layers", [(0, 12), (0, 6), (6, 12), (3, 10)])
@pytest.mark.parametrize(
    ("src_padded", "pieces"),
    [
        (9, [Piece(5, (0, 4), 9, 9)]),  # one whole token microbatch
        (9, [Piece(5, (2, 4), 9, 12), Piece(6, (0, 3), 4, 4)]),  # merge into a longer one, split off a shorter one
        (7, [Piece(1, (1, 2), 3, 20), Piece(2, (0, 1), 7, 7), Piece(3, (3, 5), 6, 6)]),
    ],
)
def test_every_cell_moves_exactly_once_right_aligned(src_layers, src_padded: int, pieces: list[Piece]) -> None:
    cells = _cells(plan_pieces(pieces, src_padded, src_layers, TOKEN_STAGES), pieces, src_layers, TOKEN_STAGES)
    n_layers = src_layers[1] - src_layers[0]
    assert len(cells) == sum(n_layers * p.n_rows * p.longest for p in pieces)
    first_row = 0
    for piece in pieces:
        for (stage, mb, row, layer, d_pos), (s_row, s_pos) in cells.items():
            if mb != piece.dst_microbatch or not first_row <= s_row < first_row + piece.n_rows:
                continue
            assert row - piece.dst_rows[0] == s_row - first_row, "a row keeps its identity"
            assert layer in range(*TOKEN_STAGES[stage])
            assert s_pos >= src_padded - piece.longest, "only positions holding prompts move"
            assert d_pos - s_pos == piece.dst_padded - src_padded, "left padding: right-aligned"
        first_row += piece.n_rows


def test_split_across_depths_follows_the_token_stages() -> None:
    transfers = plan_pieces([Piece(0, (0, 4), 10, 10)], 10, (2, 11), TOKEN_STAGES)
    assert [(t.dst_stage, t.layers) for t in transfers] == [(0, (2, 4)), (1, (4, 9)), (2, (9, 11))]


@pytest.mark.parametrize("dst_stages", [[(0, 4), (5, 12)], [(0, 6), (4, 12)], [(0, 6)]])
def test_token_stages_that_do_not_cover_the_layers_once_are_refused(dst_stages) -> None:
    with pytest.raises(ValueError, match="cover"):
        plan_pieces([Piece(0, (0, 1), 3, 3)], 3, (0, 12), dst_stages)


def test_a_piece_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        Piece(0, (0, 2), 11, 10)
    with pytest.raises(ValueError, match="do not fit"):
        plan_pieces([Piece(0, (0, 2), 11, 12)], 10, (0, 12), TOKEN_STAGES)


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
