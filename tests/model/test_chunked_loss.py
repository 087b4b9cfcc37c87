"""ChunkedLinearCE (the head's `loss chunk N`) against the unchunked head."""

from __future__ import annotations

import pytest
import torch

from schedc.model.arch import SIZES
from schedc.model.gpt2 import GPT, ChunkedLinearCE


def test_gradcheck_float64_tiny():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=gen)
    for chunk in (1, 3, 7, 100):  # a row at a time, uneven, exact, one chunk for all
        assert torch.autograd.gradcheck(
            lambda h, w, c=chunk: ChunkedLinearCE.apply(h, w, y, c), (h, w)
        )


def _head_grads(model: GPT, x, y, scale: float, autocast: bool):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.forward_layer("head", x, y)
    (loss * scale).backward()
    return loss.detach(), x.grad, model.wte.weight.grad.clone(), model.ln_f.weight.grad.clone()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_close_to_the_unchunked_head_with_the_loss_scale(autocast):
    model = GPT(SIZES["nano"], seed=3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, model.config.n_embd, generator=gen)
    y = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    want = _head_grads(model, x, y, 1 / 3, autocast)
    model.loss_chunk = 24  # 64 tokens: 24, 24, 16
    got = _head_grads(model, x, y, 1 / 3, autocast)
    assert got[0].dtype == want[0].dtype == torch.float32
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0)  # the same mean
    if not autocast:
        for g, w in zip(got[1:], want[1:]):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-8)
    else:  # grad h and ln_f's: the same bf16 kernels row by row; wte's: bf16 per chunk
        assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
        # each chunk's part rounded to bf16 (8 bits) before the fp32 sum, vs the whole sum
        # rounded once: measured ||diff|| / ||unchunked|| 2.4e-3
        assert (got[2] - want[2]).norm() <= 1e-2 * want[2].norm()
    # the tied weight's head gradient adds to the embedding's, as unchunked
    assert got[2].abs().sum() > 0 and model.lm_head.weight is model.wte.weight
