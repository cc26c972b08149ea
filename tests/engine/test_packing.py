"""Sequence packing and token-budget micro-batches.

The plan and the pack/unpack index maps are pure tensor code (tested here directly); the engine
tests run the packed path through megatron at world size 1 and at TP=2+SP, PP=2, EP=2, DP=2 (one
single-process launch, one torchrun launch) and compare it with the padded path.
"""

from __future__ import annotations

import random

import pytest
import torch

from sorl_megatron.engine.packing import (
    DUMMY,
    PackedRow,
    balanced_bins,
    first_fit_decreasing,
    make_plan,
    plan_packed,
    plan_token_budget,
)
from sorl_megatron.engine.rl_batch import BatchError
from sorl_megatron.engine.vocab_parallel import shift_to_token_positions

from .batches import make_batch


def _plan(lengths, dp=2, budget=40, multiple=1):
    rows = torch.arange(len(lengths)) + 100  # global ids need not start at 0
    return rows, plan_packed(rows, torch.tensor(lengths), dp, budget, multiple, "schedule.max_tokens_per_micro_batch")


def test_first_fit_decreasing_and_balanced_bins():
    lens = [7, 5, 5, 4, 3, 2, 2, 1]
    bins = first_fit_decreasing(lens, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lens[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 29 tokens: 3 bins is the least possible
    loads = sorted(sum(lens[i] for i in b) for b in balanced_bins(lens, 3))
    assert loads == [9, 10, 10]
    assert balanced_bins([3], 2) == [[0], []]  # fewer items than bins: an empty bin


@pytest.mark.parametrize("seed", range(5))
def test_packed_plan_covers_every_row_once_within_budget_and_balances_ranks(seed):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 40) for _ in range(rnd.randint(3, 60))]
    dp = rnd.choice([1, 2, 4])
    rows, plan = _plan(lengths, dp=dp, budget=40, multiple=2)
    ids = torch.cat([mb for rank in plan.micro for mb in rank])
    real = ids[ids != DUMMY]
    assert sorted(real.tolist()) == rows.tolist()  # every row exactly once
    assert len({len(rank) for rank in plan.micro}) == 1  # the same number of micro-batches on every rank
    length_of = dict(zip(rows.tolist(), lengths))
    loads = [[sum(length_of.get(int(r), 1) for r in mb) for mb in rank] for rank in plan.micro]
    assert max(max(r) for r in loads) <= 40
    assert plan.seq_len % 2 == 0 and plan.seq_len >= max(max(r) for r in loads)
    k = plan.micro_batches_per_rank
    assert k * dp >= len(first_fit_decreasing(lengths, 40))  # no fewer rows than FFD needs
    assert k == 1 or k <= -(-len(first_fit_decreasing(lengths, 40)) // dp) + 1
    per_rank = [sum(r) for r in loads]
    assert max(per_rank) - min(per_rank) <= max(lengths)  # balanced to within one trajectory
    assert plan.real_tokens == sum(lengths)
    assert plan.padding_frac == pytest.approx(1 - sum(lengths) / (dp * k * plan.seq_len))


def test_packed_plan_pads_empty_rows_with_a_dummy_and_names_the_budget():
    rows, plan = _plan([5], dp=2, budget=8)
    assert [len(r) for r in plan.micro] == [1, 1] and plan.has_dummy
    assert sorted(torch.cat([plan.micro[0][0], plan.micro[1][0]]).tolist()) == [DUMMY, 100]
    with pytest.raises(BatchError, match=r"schedule.max_tokens_per_micro_batch=8 is below the longest trajectory "
                                         r"\(9 tokens, row 101\)"):
        _plan([5, 9, 2], budget=8)


def test_token_budget_plan_follows_the_sequence_length():
    rows = torch.arange(12)
    lengths = torch.full((12,), 10)
    plan = plan_token_budget(rows, lengths, 2, budget=64, seq_len=16, key="k", what="w")
    assert plan.micro_batches_per_rank == 2 and [len(mb) for mb in plan.micro[0]] == [3, 3]  # 6 rows: 4 + 2 -> 3 + 3
    assert torch.equal(torch.cat(plan.micro[0] + plan.micro[1]), rows)
    plan = plan_token_budget(torch.arange(10), torch.full((10,), 10), 2, budget=64, seq_len=16, key="k", what="w")
    assert [mb.tolist() for mb in plan.micro[1]] == [[5, 6, 7], [8, 9, DUMMY]]
    assert plan.padding_frac == pytest.approx(1 - 100 / (12 * 16))
    with pytest.raises(BatchError, match="data-parallel size 2"):
        plan_token_budget(torch.arange(5), torch.full((5,), 3), 2, budget=64, seq_len=16, key="k", what="w")


def test_interleaved_pipelines_get_whole_groups_of_micro_batches():
    rows, lengths = torch.arange(5), torch.tensor([9, 3, 4, 2, 5])
    packed = plan_packed(rows, lengths, 1, 40, 1, "k", micro_multiple=4)  # one row would do; VPP wants 4
    assert packed.micro_batches_per_rank == 4 and sorted(torch.cat(packed.micro[0]).tolist()) == list(range(5))
    budget = plan_token_budget(rows, lengths, 1, budget=40, seq_len=10, key="k", what="w", micro_multiple=2)
    assert [len(mb) for mb in budget.micro[0]] == [3, 3]  # 4 rows a micro-batch would be 2; 2 groups of 3


def test_make_plan_default_budget_and_fixed_cut():
    rows, lengths = torch.arange(8), torch.tensor([3, 12, 5, 7, 12, 1, 4, 6])
    kw = dict(dp=2, micro_batch_size=2, seq_len=12, multiple=1, key="k", what="batching.mini_batch_size")
    fixed = make_plan(rows, lengths, pack=False, max_tokens=None, **kw)
    assert [mb.tolist() for mb in fixed.micro[1]] == [[4, 5], [6, 7]]
    assert fixed.padding_frac == pytest.approx(1 - 50 / 96)
    packed = make_plan(rows, lengths, pack=True, max_tokens=None, **kw)  # budget 2 x 12
    assert packed.packed and packed.seq_len <= 24 and packed.padding_frac < fixed.padding_frac
    with pytest.raises(BatchError, match="batching.mini_batch_size: 8 rows are not a multiple"):
        make_plan(rows, lengths, pack=False, max_tokens=None, **{**kw, "micro_batch_size": 3})


def test_packed_row_pack_and_unpack_every_field():
    b = make_batch(rows=6, seq=12, seed=4)
    lengths = b.attention_mask.sum(1)
    rows = torch.tensor([4, 1, 3])
    T = int(lengths[rows].sum()) + 3
    p = PackedRow.build(rows, lengths[rows], T)
    g = torch.Generator().manual_seed(0)
    fields = {k: v for k, v in b.tensors().items() if v.dim() == 2}
    fields["turn_ids"] = torch.cumsum(b.loss_mask, 1)
    fields["routed_experts"] = torch.randint(0, 8, (6, 12, 2, 2), generator=g, dtype=torch.int32)
    for name, t in fields.items():
        packed = p.pack(t, fill=-1 if name == "routed_experts" else 0)
        assert packed.shape[:2] == (1, T)
        back = p.unpack(packed, 12, fill=0)
        want = torch.where(b.attention_mask[rows].bool().view((3, 12) + (1,) * (t.dim() - 2)), t[rows], 0)
        assert torch.equal(back, want.to(back.dtype)), name
        assert (packed[0, -3:] == (-1 if name == "routed_experts" else 0)).all()
    # positions restart per row; cu_seqlens has the tail as its own segment
    pos = p.pack_positions()[0]
    ends = torch.cumsum(lengths[rows], 0)
    assert pos[0] == 0 and (pos[ends[:-1]] == 0).all() and torch.equal(pos[-3:], torch.arange(3))
    assert p.cu_seqlens.tolist() == [0] + ends.tolist() + [T] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == int(lengths[rows].max())
    # predictions: the packed twin of shift_to_token_positions (0 at t = 0 and on padding)
    pred = torch.randn(1, T, generator=g, requires_grad=True)
    rows_pred = p.unpack(pred, 12)
    want = shift_to_token_positions(rows_pred.detach()) * b.attention_mask[rows]
    got = p.unpack_predictions(pred, 12)
    assert torch.equal(got, want)
    got.sum().backward()  # gradient flows back to exactly the predictions that were used
    used = torch.zeros(T)
    for s, n in zip((ends - lengths[rows]).tolist(), lengths[rows].tolist()):
        used[s:s + n - 1] = 1
    assert torch.equal(pred.grad[0], used)


def test_packed_row_rejects_overfull_rows():
    with pytest.raises(BatchError, match="more than the packed length"):
        PackedRow.build(torch.tensor([0, 1]), torch.tensor([5, 6]), 10)


# ---------------------------------------------------------------- the engine: packed == padded

LAYOUTS = {"pack_ws1": "tp=1", "pack_tp2": "tp=2", "pack_pp2": "pp=2", "pack_ep2": "ep=2", "pack_dp2": "tp=1"}
EXACT = 1e-6


def _launch(engine_models, engine_work, tags, nproc, name):
    from .conftest import MODEL, launch

    cases = [{"op": "packing", "model": MODEL, "layout": LAYOUTS[t], "tag": t} for t in tags]
    return launch(engine_models, engine_work, cases, nproc, name)


@pytest.fixture(scope="module")
def packing_ws1(engine_models, engine_work):
    return _launch(engine_models, engine_work, ["pack_ws1"], 1, "pack1")


@pytest.fixture(scope="module")
def packing_ws2(engine_models, engine_work):  # one torchrun launch for every 2-process layout
    return _launch(engine_models, engine_work, ["pack_tp2", "pack_pp2", "pack_ep2", "pack_dp2"], 2, "pack2")


@pytest.mark.parametrize("tag", list(LAYOUTS))
def test_packed_and_token_budget_passes_equal_the_padded_one(request, tag):
    r = request.getfixturevalue("packing_ws1" if tag == "pack_ws1" else "packing_ws2")[tag]
    assert r["ok"], f"{tag} failed: {r.get('error')}\n{r.get('traceback', '')}"
    for variant in ("budget", "packed"):
        d = r[variant]
        assert d["logprobs"] <= EXACT and d["entropy"] <= EXACT, (variant, d)
        assert d["r3_routes_equal"] and d["live_routes_equal"], variant  # R3 replay and the R2 record carried through
        for key, diff in d["metrics"].items():
            assert diff <= EXACT, (variant, key, diff)
        assert d["grads"] <= EXACT, (variant, d["grads"])
        assert d["params"] <= 1e-5, (variant, d["params"])  # after one Adam step (eps 1e-6 amplifies ~1e-8)
    u = r["update"]["padded"]
    # the batch exercises what the comparison claims to cover
    assert u["clip_frac"] > 0 and u["turn_ratio/spread"] > 0 and u["kl_ref"] != 0 and u["grad_norm"] > 0
    assert u["routing/replay_mismatch_frac"] > 0.3  # random R3 routes: replayed, not the live ones
    b = r["batching"]
    assert b["packed"]["batching/padding_frac"] < b["padded"]["batching/padding_frac"]
    assert b["padded"]["batching/tokens"] == b["packed"]["batching/tokens"] == sum(r["lengths"])
    if tag in ("pack_dp2", "pack_ep2"):  # 2 micro-batches per rank either way (99 tokens, budget 40)
        assert b["packed"]["batching/micro_batches"] == b["padded"]["batching/micro_batches"] == 2
    else:  # dp = 1: 3 packed rows; 3 micro-batches of 3 padded rows (one a dummy) under the budget
        assert b["packed"]["batching/micro_batches"] == 3 and b["padded"]["batching/micro_batches"] == 4
        assert b["budget"]["batching/micro_batches"] == 3
    assert r["old_batching"]["packed"]["batching/padding_frac"] < r["old_batching"]["padded"]["batching/padding_frac"]
    c = r["critic"]
    assert c["values"] <= EXACT and c["value_loss"] <= EXACT and c["grads"] <= EXACT, c
    assert c["value_clip_frac"] > 0 and c["padding_frac"][1] < c["padding_frac"][0]
