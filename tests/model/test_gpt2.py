"""The torch model matches arch.py's table and can be cut at any layer boundary."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from schedc.model.arch import SIZES, GPTConfig
from schedc.model.gpt2 import GPT

NANO = SIZES["nano"]


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, NANO.vocab_size, (3, 16), generator=gen)
    targets = torch.randint(0, NANO.vocab_size, (3, 16), generator=gen)
    return idx, targets


def meta_model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_parameters_match_arch(size):
    cfg = SIZES[size]
    model = meta_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert [n for n, _ in model.named_parameters()] == [p.name for p in cfg.params]
    for layer in cfg.layers:
        got = model.layer_parameters(layer)
        assert [(n, tuple(p.shape)) for n, p in got] == [
            (p.name, p.shape) for p in cfg.layer_params(layer)
        ]
        assert sum(p.numel() * p.element_size() for _, p in got) == cfg.layer_bytes(layer)
    assert sum(p.numel() for p in model.parameters()) == cfg.numel
    assert model.lm_head.weight is model.wte.weight


def test_gpt2_124m():
    assert sum(p.numel() for p in meta_model(SIZES["gpt2"]).parameters()) == 124_439_808


def test_init_is_deterministic_and_nanogpt_shaped():
    a, b, c = GPT(NANO, seed=1), GPT(NANO, seed=1), GPT(NANO, seed=2)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
        elif name.endswith(".weight"):
            assert torch.all(pa == 1), name  # LayerNorm gain
        else:
            assert torch.all(pa == 0), name  # bias
    big = GPT(SIZES["tiny"], seed=0)
    assert big.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    proj = torch.cat([blk.mlp.c_proj.weight.flatten() for blk in big.h])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.02)


def test_forward_range_composes_to_forward(batch):
    idx, targets = batch
    model = GPT(NANO, seed=0)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, NANO.vocab_size) and loss.shape == ()
    assert torch.equal(model.forward_range("embed", "head", idx, targets), loss)
    assert torch.equal(model.forward_range("embed", "head", idx), logits)
    x = model.forward_range("embed", "h.0", idx)
    assert x.shape == (3, 16, NANO.n_embd)
    assert torch.equal(model.forward_range("h.1", "head", x, targets), loss)
    x = model.forward_layer("embed", idx)
    for layer in ("h.0", "h.1"):
        x = model.forward_layer(layer, x)
    assert torch.equal(model.forward_layer("head", x, targets), loss)


def test_bad_layer_names_and_ranges(batch):
    model = GPT(NANO)
    with pytest.raises(KeyError, match=r"h\.2"):
        model.forward_layer("h.2", torch.zeros(1, 1, NANO.n_embd))
    with pytest.raises(ValueError, match="backwards"):
        model.forward_range("head", "h.0", batch[0])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, NANO.block_size + 1, dtype=torch.long))


def full_backward(model, idx, targets):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, targets)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def cut_backward(model, segments, idx, targets):
    """Forward segment by segment on detached inputs, then backward segment by segment in
    reverse, handing each segment's input gradient to the one before: the executor's way."""
    model.zero_grad(set_to_none=True)
    inputs, outputs, x = [], [], idx
    for first, last in segments:
        x = x if first == "embed" else x.detach().requires_grad_()
        inputs.append(x)
        x = model.forward_range(first, last, x, targets)
        outputs.append(x)
    grad = None  # the loss is a scalar: its own gradient is 1
    for inp, out in zip(reversed(inputs), reversed(outputs), strict=True):
        torch.autograd.backward(out, grad)
        grad = inp.grad
    return {n: p.grad.clone() for n, p in model.named_parameters()}


PER_LAYER = [(layer, layer) for layer in NANO.layers]
TWO_SEGMENTS = [("embed", "h.0"), ("h.1", "head")]


@pytest.mark.parametrize("segments", [PER_LAYER, TWO_SEGMENTS], ids=["per-layer", "two-segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cut_backward_equals_full_backward(batch, segments, dtype):
    idx, targets = batch
    model = GPT(NANO, seed=0).to(dtype)
    want = full_backward(model, idx, targets)
    got = cut_backward(model, segments, idx, targets)
    assert got.keys() == want.keys()
    tol = {"rtol": 1e-12, "atol": 1e-15} if dtype == torch.float64 else {}
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)


def test_tied_weight_gets_gradient_from_head_and_embed(batch):
    idx, targets = batch
    model = GPT(NANO, seed=0)
    x = model.forward_layer("embed", idx)
    h = model.forward_range("h.0", "h.1", x.detach())
    model.forward_layer("head", h.detach().requires_grad_(), targets).backward()
    from_head = model.wte.weight.grad.clone()
    assert from_head.abs().sum() > 0
    total = full_backward(model, idx, targets)["wte.weight"]
    assert not torch.allclose(total, from_head)  # embed adds its share on top


def test_embedding_into_grad_adds_in_place_and_falls_back_to_the_dense_gradient():
    """EmbeddingIntoGrad: with an fp32 .grad the rows are added into it (autograd gets no
    weight gradient); without one, its gradient is embedding's own, bit for bit."""
    from schedc.model.gpt2 import EmbeddingIntoGrad

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=gen).requires_grad_()
    idx = torch.randint(0, 50, (3, 20), generator=gen)  # repeated tokens: rows add up
    g = torch.randn(3, 20, 8, generator=gen)
    F.embedding(idx, w).backward(g)
    dense = w.grad
    w.grad = None
    EmbeddingIntoGrad.apply(idx, w).backward(g)
    assert torch.equal(w.grad, dense)  # no .grad yet: the dense gradient
    base = torch.randn(50, 8, generator=gen)
    w.grad = into = base.clone()
    EmbeddingIntoGrad.apply(idx, w).backward(g)
    assert w.grad is into  # added in place, the buffer kept
    torch.testing.assert_close(into, base + dense, rtol=0, atol=1e-6)
    # a bf16 .grad (a bf16 gather): the dense bf16 gradient, then autograd's own add
    w16 = w.detach().bfloat16().requires_grad_()
    F.embedding(idx, w16).backward(g.bfloat16())
    dense16 = w16.grad
    w16.grad = base.bfloat16()
    EmbeddingIntoGrad.apply(idx, w16).backward(g.bfloat16())
    assert torch.equal(w16.grad, base.bfloat16() + dense16)


def test_cast_into_grad_equals_autocasts_cast_back():
    """CastIntoGrad: the head's bf16 weight gradient added into fp32 .grad equals autocast's
    upcast-then-accumulate exactly (the upcast is exact)."""
    from schedc.model.gpt2 import CastIntoGrad

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 8, generator=gen).requires_grad_()
    h = torch.randn(6, 8, generator=gen)
    base = torch.randn(40, 8, generator=gen)
    w.grad = base.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out = F.linear(h, w)
    want_out.float().square().sum().backward()
    want = w.grad.clone()
    w.grad = into = base.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.linear(h, CastIntoGrad.apply(w, torch.bfloat16))
    assert torch.equal(out, want_out)
    out.float().square().sum().backward()
    assert w.grad is into and torch.equal(into, want)
