"""The batch transfer's pieces on one process (engine/batch_transfer.py, RoutedRows); the
multi-rank equality with the whole-batch broadcast is test_engine.py's ``transfer`` cases."""

from __future__ import annotations

import pytest
import torch

from sorl_megatron.engine.batch_transfer import describe, route_payload, routed_rows, share_batch, wire_dtype
from sorl_megatron.engine.rl_batch import BatchError, RLBatch, RoutedRows, validate_batch


def _batch(experts: int = 128) -> RLBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 8, 5])
    att = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).long()
    routes = torch.randint(0, experts, (4, 8, 3, 2), generator=g, dtype=torch.int32)
    routes = torch.where(att[:, :, None, None].bool(), routes, torch.full_like(routes, -1))
    routes[:, 0] = -1  # a missing route (the live router decides) travels as -1
    ids = torch.randint(0, 50_000, (4, 8), generator=g) * att
    return RLBatch(input_ids=ids, attention_mask=att, loss_mask=att * (torch.arange(8) > 1), routed_experts=routes)


def test_wire_types_are_the_smallest_that_hold_the_values():
    assert wire_dtype(torch.tensor([-1, 127])) == torch.int8
    assert wire_dtype(torch.tensor([-1, 128])) == torch.int16
    assert wire_dtype(torch.tensor([0, 151_935])) == torch.int32
    assert wire_dtype(torch.tensor([0, 2**40])) == torch.int64
    assert wire_dtype(torch.tensor([0.5])) == torch.float32
    meta = describe(_batch())
    assert meta["routes"] == ((4, 8, 3, 2), torch.int32, torch.int8)
    assert meta["fields"]["input_ids"][2] == torch.int32 and meta["fields"]["attention_mask"][2] == torch.int8


def test_routes_of_some_rows_read_like_the_dense_tensor():
    b = _batch()
    rows = torch.tensor([0, 2])
    payload = route_payload(b.routed_experts, b.attention_mask, rows, torch.int8)
    assert payload.dtype == torch.int8 and payload.shape == (6 + 8, 3, 2)  # real tokens only
    held = routed_rows(payload, b.attention_mask, rows, tuple(b.routed_experts.shape), torch.int32)
    assert held.shape == (4, 8, 3, 2) and held.dtype == torch.int32
    assert torch.equal(held[rows], b.routed_experts[rows])
    assert torch.equal(held[torch.tensor([2, 0, 2])], b.routed_experts[[2, 0, 2]])
    # dummy rows (ids >= batch size) and sequence padding read -1, as the dense padding does
    assert bool((held[torch.tensor([4, 5])] == -1).all())
    padded = b.replace(routed_experts=held).padded_seq(12).padded_rows(6)[0]
    assert padded.routed_experts.shape == (4, 12, 3, 2)
    got = padded.routed_experts[torch.tensor([0, 5])]
    assert torch.equal(got[0, :8], b.routed_experts[0]) and bool((got[0, 8:] == -1).all())
    assert bool((got[1] == -1).all())
    with pytest.raises(BatchError, match=r"rows \[1\] were not sent to this rank"):
        held[torch.tensor([0, 1])]


def test_packed_routes_send_what_the_dense_ones_do():
    """Rank 0's routes as collate packs them (no padding, compact type) give each rank the payload
    the dense tensor gave, and read as it does."""
    b = _batch()
    att = b.attention_mask.bool()
    packed = RoutedRows(rows=torch.arange(4), lengths=att.sum(1), values=b.routed_experts[att].to(torch.int8),
                        batch_size=4, seq_len=8, dtype=torch.int32)
    assert describe(b.replace(routed_experts=packed))["routes"] == describe(b)["routes"]
    for rows in (torch.tensor([0, 2]), torch.tensor([3]), torch.tensor([1, 2, 3])):
        assert torch.equal(route_payload(packed, b.attention_mask, rows, torch.int8),
                           route_payload(b.routed_experts, b.attention_mask, rows, torch.int8))
    assert torch.equal(packed[torch.arange(4)], b.routed_experts)
    mask = torch.tensor([True, False, True, True])  # a row mask reads as on the dense tensor
    assert torch.equal(packed[mask], b.routed_experts[mask])


def test_validation_reads_the_held_rows():
    b = _batch(experts=4)
    rows = torch.tensor([1, 3])
    payload = route_payload(b.routed_experts, b.attention_mask, rows, torch.int8)
    held = routed_rows(payload, b.attention_mask, rows, tuple(b.routed_experts.shape), torch.int32)
    validate_batch(b.replace(routed_experts=held), num_layers=3, topk=2, num_experts=4)
    with pytest.raises(BatchError, match="routed_experts values must be in"):
        validate_batch(b.replace(routed_experts=held), num_layers=3, topk=2, num_experts=3)
    with pytest.raises(BatchError, match="routed_experts shape"):
        validate_batch(b.replace(routed_experts=held), num_layers=2, topk=2)
    assert isinstance(held, RoutedRows)


def test_world_size_1_returns_the_batch_itself():
    b = _batch()
    assert share_batch(b, lambda _: [], 0) is b
