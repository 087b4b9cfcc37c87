"""ChunkedLinearCE (the head's `loss chunk N`) against the unchunked head."""

from __future__ import annotations

import pytest
import torch

from schedc.model.arch import SIZES
from schedc.model.gpt2 import GPT, ChunkedLinearCE, chunked_loss


def test_gradcheck_float64_tiny():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=gen)
    for chunk in (1, 3, 7, 100):  # a row at a time, uneven, exact, one chunk for all
        assert torch.autograd.gradcheck(
            lambda h, w, c=chunk: ChunkedLinearCE.apply(h, w, y, c), (h, w)
        )


def _head_grads(model: GPT, x, y, scale: float, autocast: bool, told: bool = True):
    """The head's loss and gradients for a backward from loss x scale; `told`: the model
    knows the scale in forward (as the executor's does)."""
    model.zero_grad(set_to_none=True)
    model.loss_scale = scale if told else 1.0
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


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_grad_other_than_the_folded_scale_rescales_the_gradients(autocast):
    """Forward makes the gradients for the scale it was told; backward multiplies them by
    grad / scale when another grad arrives: one more rounding, nothing else."""
    model = GPT(SIZES["nano"], seed=3)
    model.loss_chunk = 24
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, model.config.n_embd, generator=gen)
    y = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    told = _head_grads(model, x, y, 1 / 3, autocast)
    untold = _head_grads(model, x, y, 1 / 3, autocast, told=False)
    assert torch.equal(told[0], untold[0])
    rtol = 1e-6 if not autocast else 1e-2  # bf16: grad h rounded before the scale
    for g, w in zip(told[1:], untold[1:]):
        assert not torch.equal(g, w) or g.abs().max() == 0  # the multiply did happen
        assert (g - w).norm() <= rtol * w.norm()


def test_a_forward_without_autograd_makes_no_gradients():
    """Under no_grad (a recomputing head's first forward) only the logits' matmul runs, once
    a chunk; with autograd each chunk's logits are made once too, and two matmuls more."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=gen)

    def matmuls(grad: bool):
        with torch.profiler.profile() as prof, torch.set_grad_enabled(grad):
            loss = chunked_loss(h, w, y, 3)  # chunks of 3, 3, 1
        names = [e.name for e in prof.events()]
        return loss, sum(n in ("aten::mm", "aten::addmm_") for n in names)

    (plain, n_plain), (fused, n_fused) = matmuls(False), matmuls(True)
    assert torch.equal(plain, fused.detach())  # the same loss either way
    assert (n_plain, n_fused) == (3, 9)
    assert plain.grad_fn is None and fused.grad_fn is not None
