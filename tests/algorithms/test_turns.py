import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_megatron.algorithms import row_segments, segment_mean_broadcast, segment_sum, segment_turns


def reference_turns(mask):
    """Per-row Python reference: maximal runs of ones."""
    turn_index, lengths = [], []
    for row in mask.tolist():
        idx, lens, k, prev = [], [], -1, 0
        for v in row:
            if v and not prev:
                k += 1
                lens.append(0)
            idx.append(k if v else -1)
            if v:
                lens[-1] += 1
            prev = v
        turn_index.append(idx)
        lengths.append(lens)
    return turn_index, lengths


def test_runs_of_ones_are_turns():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 1], [0] * 8, [1] * 8])
    seg = segment_turns(mask)
    assert seg.turn_index.tolist() == [
        [-1, 0, 0, -1, 1, 1, 1, -1],
        [0, -1, 1, -1, 2, -1, -1, 3],
        [-1] * 8,
        [0] * 8,
    ]
    assert seg.turns_per_row.tolist() == [2, 4, 0, 1]
    assert seg.turn_lengths().tolist() == [[2, 3, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [8, 0, 0, 0]]


def test_explicit_turn_ids_group_tokens_by_id():
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    ids = torch.tensor([[5, 5, -1, 5, 7, 7], [-1, 0, 0, 2, -1, -1]])
    seg = segment_turns(mask, ids)
    # row 0: id 5 spans the observation gap -> one turn of 3 tokens, then id 7 (2 tokens)
    assert seg.turn_index.tolist() == [[0, 0, -1, 0, 1, 1], [-1, 0, 0, 1, -1, -1]]
    assert seg.segment_length.tolist() == [3, 2, 2, 1]


def test_explicit_turn_ids_validated():
    mask = torch.tensor([[1, 1]])
    with pytest.raises(ValueError, match="turn_ids must be >= 0"):
        segment_turns(mask, torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="turn_ids shape"):
        segment_turns(mask, torch.tensor([[0, 0, 0]]))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        segment_turns(torch.ones(3))


def test_segment_mean_broadcast_gradient_is_one_over_turn_length():
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    x = torch.randn(1, 6, requires_grad=True)
    seg = segment_turns(mask)
    out = segment_mean_broadcast(x, seg)
    assert torch.allclose(out[0, 0], x[0, :2].mean())
    assert torch.allclose(out[0, 4], x[0, 3:].mean())
    assert out[0, 2].item() == 0.0
    out.sum().backward()
    # each token of a turn receives |turn| * (1/|turn|) = 1; observation tokens nothing
    assert x.grad.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]


def test_row_segments_and_empty_batch():
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    seg = row_segments(mask)
    assert seg.num_segments == 1 and seg.segment_length.tolist() == [2]
    empty = segment_turns(torch.zeros(0, 5, dtype=torch.long))
    assert empty.num_segments == 0 and empty.turn_lengths().shape == (0, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=7, max_size=7), min_size=1, max_size=6))
def test_segmentation_matches_python_reference(rows):
    mask = torch.tensor(rows)
    seg = segment_turns(mask)
    ref_index, ref_lengths = reference_turns(mask)
    assert seg.turn_index.tolist() == ref_index
    assert seg.turns_per_row.tolist() == [len(lengths) for lengths in ref_lengths]
    assert seg.segment_length.tolist() == [float(x) for lengths in ref_lengths for x in lengths]
    # explicit ids equal to the derived ones give the same segments
    again = segment_turns(mask, seg.turn_index.clamp(min=0))
    assert torch.equal(again.segment_index, seg.segment_index)
    # segment sums add up to the masked total
    vals = torch.randn(mask.shape)
    assert torch.allclose(segment_sum(vals, seg).sum(), (vals * mask).sum(), atol=1e-5)
