"""Pure-Python parts of the engine: batch validation, padding, SGLang routing decode, vocab math."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from sorl_megatron.engine.rl_batch import BatchError, RLBatch, routed_experts_from_sglang, validate_batch
from sorl_megatron.engine.vocab_parallel import next_token_targets, shift_to_token_positions

from .batches import make_batch


def test_valid_batch_fills_defaults():
    b = validate_batch(RLBatch(input_ids=torch.zeros(2, 5, dtype=torch.long)))
    assert b.attention_mask.shape == (2, 5) and b.loss_mask.sum() == 0
    assert torch.equal(b.position_ids[1], torch.arange(5))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(advantages=torch.zeros(8, 3)), "advantages shape"),
        (dict(loss_mask=make_batch().attention_mask), "loss_mask[:, 0]"),
        (dict(input_ids=torch.zeros(8, 12)), "integer"),
        (dict(old_logprobs=torch.full((8, 12), float("nan"))), "non-finite"),
        (dict(routed_experts=torch.zeros(8, 12, 2)), "routed_experts must be"),
        (dict(group_ids=torch.zeros(3)), "group_ids"),
    ],
)
def test_invalid_batches_name_the_field(change, message):
    with pytest.raises(BatchError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_batch(make_batch().replace(**change), num_layers=2, topk=2, num_experts=4)


def test_row_and_seq_padding():
    b = make_batch(rows=5, seq=11)
    p, n = b.padded_rows(4)
    assert n == 5 and p.batch_size == 8 and p.loss_mask[5:].sum() == 0 and (p.attention_mask[5:, 0] == 1).all()
    q = b.replace(routed_experts=torch.zeros(5, 11, 2, 2, dtype=torch.int32)).padded_seq(4)
    assert q.seq_len == 12 and (q.routed_experts[:, 11] == -1).all() and q.attention_mask[:, 11].sum() == 0


def test_sglang_routed_experts_alignment():
    prompt, completion, layers, k = 4, 3, 2, 2
    n = prompt + completion - 1
    arr = np.arange(n * layers * k, dtype="<i4").reshape(n, layers, k) % 4
    enc = base64.b64encode(arr.tobytes()).decode()
    out = routed_experts_from_sglang(enc, num_layers=layers, topk=k, seq_len=9)
    assert out.shape == (9, layers, k)
    assert torch.equal(out[:n], torch.from_numpy(arr))
    assert (out[n:] == -1).all()  # last token (never fed) and padding
    shifted = routed_experts_from_sglang(
        base64.b64encode(arr[2:].tobytes()), num_layers=layers, topk=k, seq_len=9, start_len=2
    )
    assert (shifted[:2] == -1).all() and torch.equal(shifted[2:n], torch.from_numpy(arr[2:]))
    with pytest.raises(BatchError):
        routed_experts_from_sglang(enc, num_layers=layers, topk=k, seq_len=3)


def test_token_alignment_helpers():
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(next_token_targets(ids), torch.tensor([[6, 7, 0]]))
    assert torch.equal(shift_to_token_positions(torch.tensor([[1.0, 2.0, 3.0]])), torch.tensor([[0.0, 1.0, 2.0]]))


def test_vocab_parallel_entropy_matches_autograd_single_rank():
    from megatron.core import parallel_state  # noqa: F401  (groups not initialized: TP = 1 path)

    from sorl_megatron.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs_entropy

    logits = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    ent = vocab_parallel_entropy(logits).float()
    logp = torch.log_softmax(logits.float(), -1)
    ref = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(ent, ref, atol=1e-5)
    targets = torch.randint(0, 7, (3, 4))
    lp, _ = vocab_parallel_logprobs_entropy(logits, targets)
    assert torch.allclose(lp.float(), logp.gather(-1, targets[..., None])[..., 0], atol=1e-5)
    w = torch.randn(3, 4)
    (g,) = torch.autograd.grad((ent * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    assert torch.allclose(g.float(), g_ref.float(), atol=1e-5)
