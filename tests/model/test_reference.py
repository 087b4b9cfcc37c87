"""The single-process reference step: deterministic, split-invariant, and it learns."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from schedc.model.arch import SIZES
from schedc.model.config import OptimConfig
from schedc.model.data import GlobalBatches, corpus_tokens
from schedc.model.reference import (
    AdamW,
    Reference,
    clip_coef,
    global_grad_norm,
    init_model,
    make_adamw,
)

NANO = SIZES["nano"]
OPT = OptimConfig(lr=1e-3, min_lr=1e-4, warmup=2)
S, T = 8, 32


@pytest.fixture(scope="module")
def batches():
    return GlobalBatches(corpus_tokens(), T, S, NANO.vocab_size, origin="corpus")


def reference(batches, micro_seqs=2, seed=0, dtype=torch.float32, opt=OPT):
    return Reference(NANO, opt, batches, micro_seqs, total_steps=10, seed=seed, dtype=dtype)


def assert_tensors_close(got, want, **tol):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)


def test_deterministic_given_the_seed(batches):
    a, b, c = reference(batches), reference(batches), reference(batches, seed=1)
    for _ in range(2):
        ra, rb, rc = a.step(), b.step(), c.step()
        assert (ra.loss, ra.grad_norm, ra.lr) == (rb.loss, rb.grad_norm, rb.lr)
        assert_tensors_close(ra.grads, rb.grads, rtol=0, atol=0)
        assert_tensors_close(ra.params, rb.params, rtol=0, atol=0)
        assert ra.loss != rc.loss


@pytest.mark.parametrize("micro_seqs", [1, 2, 4])
def test_micro_batch_size_does_not_change_the_step(batches, micro_seqs):
    split, whole = reference(batches, micro_seqs).step(), reference(batches, S).step()
    assert split.loss == pytest.approx(whole.loss, rel=1e-6)
    assert split.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    # Gradients differ only by fp32 summation order (observed: < 1e-7 absolute).
    assert_tensors_close(split.grads, whole.grads, rtol=1e-5, atol=1e-6)
    # Adam's first update is lr * g / (|g| + eps): where |g| is near eps, a rounding-level
    # difference in g moves the update by a visible fraction of lr (observed: < 1% of lr).
    assert_tensors_close(split.params, whole.params, rtol=0, atol=0.02 * OPT.lr)


def test_float64_mode(batches):
    split = reference(batches, 2, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in split.model.parameters())
    assert split.model.lm_head.weight is split.model.wte.weight  # tying survives .to()
    whole = reference(batches, S, dtype=torch.float64)
    single = reference(batches, S)
    for _ in range(2):
        a, b, c = split.step(), whole.step(), single.step()
        assert_tensors_close(a.grads, b.grads, rtol=1e-10, atol=1e-13)
        assert_tensors_close(a.params, b.params, rtol=0, atol=1e-12)
        assert a.loss == pytest.approx(c.loss, rel=1e-5)  # fp32 is the same computation


def test_loss_is_the_global_batch_mean_and_grads_are_unclipped(batches):
    opt = OptimConfig(lr=1e-3, warmup=0, clip=0.01)  # clips every step
    model = init_model(NANO, seed=0)
    x, y = batches.global_batch(0)
    _, loss = model(x, y)
    result = reference(batches, 2, opt=opt).step()
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    assert result.grad_norm > opt.clip
    assert global_grad_norm(list(result.grads.values())).item() == pytest.approx(
        result.grad_norm, rel=1e-6
    )


def test_step_equals_plain_torch(batches):
    """One whole-batch step written with torch's own clipping and AdamW."""
    opt = OptimConfig(lr=2e-3, warmup=3, clip=0.5)
    model = init_model(NANO, seed=3)
    optimizer = make_adamw(model.named_parameters(), opt)
    want = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        x, y = batches.global_batch(step)
        model(x, y)[1].backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip)
        for group in optimizer.param_groups:
            group["lr"] = opt.lr_at(step, 10)
        optimizer.step()
        want.append((norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    ref = Reference(NANO, opt, batches, S, total_steps=10, seed=3)
    for step, (norm, params) in enumerate(want):
        result = ref.step()
        assert result.step == step and result.lr == opt.lr_at(step, 10)
        assert result.grad_norm == pytest.approx(norm, rel=1e-6)
        assert_tensors_close(result.params, params, rtol=1e-6, atol=1e-7)


def test_clip_coef_is_torchs():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    assert torch.equal(global_grad_norm(grads), norm)
    coef = clip_coef(norm, 0.5)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * coef, rtol=0, atol=0)
    assert clip_coef(0.25, 0.5) == 1.0  # never scales up
    assert clip_coef(2.0, 1.0) == pytest.approx(0.5)


def test_adamw_groups():
    model = init_model(NANO, seed=0)
    opt = OptimConfig(weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
    optimizer = make_adamw(model.named_parameters(), opt)
    decay, no_decay = optimizer.param_groups
    assert [id(p) for p in decay["params"]] == [id(p) for p in model.parameters() if p.dim() >= 2]
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-7
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def _two_groups(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (3, 5), (4,), (7,)]
    ps = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def test_schedcs_adamw_is_torchs_bitwise_state_dict_included():
    """Same kernel, same state: three steps, the second skipped by found_inf, a parameter
    without a gradient in the first; then each loads the other's state dict."""
    kw = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, "fused": True}
    mine, theirs = AdamW(_two_groups(0), **kw), torch.optim.AdamW(_two_groups(0), **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [
            torch.randn(p.shape, generator=gen) for g in mine.param_groups for p in g["params"]
        ]
        for opt in (mine, theirs):
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if step == 0 and i == 3 else g.clone()
            opt.found_inf = torch.tensor(1.0 if step == 1 else 0.0)
            for g in opt.param_groups:
                g["lr"] = 3e-3 * (step + 1)
            opt.step()
        for a, b in zip(mine.param_groups, theirs.param_groups, strict=True):
            for p, q in zip(a["params"], b["params"], strict=True):
                assert torch.equal(p, q), step
    sd, want = mine.state_dict(), theirs.state_dict()
    assert sd["param_groups"] == want["param_groups"]
    assert sd["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        for key, t in state.items():
            got = sd["state"][i][key]
            assert got.dtype == t.dtype and got.device == t.device and torch.equal(got, t), key
    theirs.load_state_dict(sd)
    mine.load_state_dict(want)


def test_building_and_stepping_it_never_imports_the_compiler():
    """torch.optim's wrappers import torch._dynamo (1.3 s a process); schedc's AdamW does not."""
    code = """
import sys, torch
from schedc.model.arch import SIZES
from schedc.model.config import OptimConfig
from schedc.model.reference import init_model, make_adamw
model = init_model(SIZES["nano"], seed=0)
opt = make_adamw(model.named_parameters(), OptimConfig())
model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
opt.step()
opt.load_state_dict(opt.state_dict())
opt.zero_grad()
print("torch._dynamo" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]


def test_it_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match="fused"):
        AdamW(_two_groups(0), lr=1e-3)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(_two_groups(0), lr=1e-3, fused=True, amsgrad=True)


def test_rejects_uneven_micro_batches_and_long_sequences(batches):
    with pytest.raises(ValueError, match="whole number"):
        reference(batches, micro_seqs=3)
    too_long = GlobalBatches(np.arange(1000), NANO.block_size + 1, 2, NANO.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        reference(too_long)


def test_learns_the_embedded_corpus():
    cfg = SIZES["tiny"]
    data = GlobalBatches(corpus_tokens(), 64, 8, cfg.vocab_size, origin="corpus")
    opt = OptimConfig(lr=3e-3, min_lr=3e-4, warmup=5)
    ref = Reference(cfg, opt, data, micro_seqs=8, total_steps=50, seed=0)
    losses = [ref.step(record=False).loss for _ in range(50)]
    # Each step sees new text, so single losses are noisy: judge the last few together.
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses
