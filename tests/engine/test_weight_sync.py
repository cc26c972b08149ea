"""Distributed weight sync from 2 trainer ranks (TP2, EP2, PP2; FP8 at EP2) to 2 embedded
servers, in one torchrun launch (tests/engine/worker.py ``op_wsync``)."""

from __future__ import annotations

import pytest

from .conftest import MODEL, launch


@pytest.fixture(scope="module")
def wsync(engine_models, engine_work):
    cases = [{"op": "wsync", "model": MODEL, "layout": layout, "tag": f"wsync_{layout.replace('=', '')}"}
             for layout in ("tp=2", "ep=2", "pp=2")]
    cases.append({"op": "wsync", "model": MODEL, "layout": "ep=2", "precision": "fp8", "tag": "wsync_fp8"})
    # issue 20's families: MLA split over TP, block-FP8 of the MLA projections, GLM-4.5 experts
    cases += [
        {"op": "wsync", "model": "deepseek_v3", "layout": "tp=2", "tag": "wsync_deepseek_v3_tp2"},
        {"op": "wsync", "model": "deepseek_v3", "layout": "ep=2", "precision": "fp8", "tag": "wsync_deepseek_v3_fp8"},
        {"op": "wsync", "model": "glm4_moe", "layout": "ep=2", "tag": "wsync_glm4_moe_ep2"},
    ]
    return launch(engine_models, engine_work, cases, 2, "wsync")


@pytest.mark.parametrize("tag", ["wsync_tp2", "wsync_ep2", "wsync_pp2", "wsync_deepseek_v3_tp2", "wsync_glm4_moe_ep2"])
def test_servers_match_trainer_logprobs(wsync, tag):
    r = wsync[tag]
    assert r["ok"], r.get("traceback")
    assert r["versions"] == ["step_1", "step_1"]
    assert r["max_weight_diff"] == 0.0  # every tensor arrived bit for bit, on both servers
    assert r["max_logprob_diff"] <= 1e-5


def test_each_rank_sends_only_its_part(wsync):
    tp, ep, pp = (wsync[t] for t in ("wsync_tp2", "wsync_ep2", "wsync_pp2"))
    total = tp["total_bytes"]
    # TP2: rank 0 sends the gathered model, rank 1 nothing
    assert [s for s, _ in tp["sent_by_rank"]] == [total, 0]
    # PP2: each stage's sender sends its stage: both send, neither the whole model, together exactly it
    sent = [s for s, _ in pp["sent_by_rank"]]
    assert sum(sent) == total and 0 < min(sent) and max(sent) < total, sent
    # EP2: one stage, one sender: rank 1 owns experts (its dense role is data-parallel rank 1's:
    # none) and hands them to rank 0, which sends the whole model (issue 45: a group per stage)
    assert [s for s, _ in ep["sent_by_rank"]] == [total, 0]
    assert [tuple(roles) for _, roles in ep["sent_by_rank"]] == [(True, True), (False, True)]


def test_fp8_sync_is_the_quantizers_output(wsync):
    r = wsync["wsync_fp8"]
    assert r["ok"], r.get("traceback")
    assert r["quantized"] > 0 and r["max_weight_diff"] == 0.0
    assert r["versions"] == ["step_1", "step_1"]


def test_fp8_sync_of_mla_is_the_quantizers_output(wsync):
    r = wsync["wsync_deepseek_v3_fp8"]
    assert r["ok"], r.get("traceback")
    assert r["quantized"] > 0 and r["max_weight_diff"] == 0.0 and r["versions"] == ["step_1", "step_1"]
