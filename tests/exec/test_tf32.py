"""TF32 on a CPU: the emulation (tests/tf32.py) and the tolerance it measured (TOL["tf32"]).

On CUDA schedc runs fp32 matmuls on TF32 unless a schedule says `tf32 off`, and a CUDA run
is compared with the fp32 CPU reference. Emulated here, test_cuda.py's DDP and FSDP texts
(world 1, 2 steps) and an FSDP schedule on two of the pool's ranks must be within the "tf32"
bound and, for the world-1 texts, outside fp32's: the emulation does what TF32 does to
these runs, and the bound is not wider than it need be by so much that fp32's would do.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from schedc.compiler import compile_text
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from schedc.ir.spec import POLICIES, Dtype, Numerics
from schedc.lang.resolve import Overrides
from schedc.model.gpt2 import GPT, GPTConfig
from tests.exec.test_cuda import DDP, FSDP
from tests.exec.test_equivalence import THREE_UNITS, fsdp
from tests.oracle import (
    TOL,
    _assert_step,
    assert_matches,
    policy_key,
    reference_steps,
    tf32_in_effect,
)
from tests.tf32 import MODES, active, emulate_tf32, suspended, to_tf32

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def world1():
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


_tags = iter(range(10**6))


def run_world1(text: str, steps: int, mode: str = "truncate"):
    """The executor in this process (world 1, CPU), each step inside emulate_tf32(mode)."""
    c = compile_text(text, "tf32.sched", Overrides(steps=steps))
    ex = Executor(
        c,
        Comm(0, 1, tag=f"tf32-{next(_tags)}"),
        RunOptions(device="cpu", record=True, log=False),
    )
    try:
        with emulate_tf32(mode) as em:
            stats = [ex.step() for _ in range(steps)]
    finally:
        ex.close()
    return stats, em


# -- the rounding ------------------------------------------------------------------------------


def test_tf32_keeps_sign_exponent_and_10_mantissa_bits():
    x = torch.tensor([1.0, 1 + 2**-10, 1 + 2**-11, 1 + 2**-11 + 2**-20, -(1 + 2**-11), 0.0])
    assert to_tf32(x).tolist() == [1.0, 1 + 2**-10, 1.0, 1.0, -1.0, 0.0]
    assert to_tf32(x, "round").tolist() == [1.0, 1 + 2**-10, *[1 + 2**-10] * 2, -(1 + 2**-10), 0.0]
    t = torch.randn(10_000) * torch.logspace(-20, 20, 10_000)
    kept = t.clone()
    for mode, bound in (("truncate", 2**-10), ("round", 2**-11)):
        r = to_tf32(t, mode)
        assert (r.view(torch.int32) & 0x1FFF).eq(0).all()  # the low 13 bits dropped
        assert torch.equal(to_tf32(r, mode), r)  # TF32 values stay as they are
        rel = (r.double() - t.double()) / t.double()
        assert rel.abs().max() <= bound
    trunc = to_tf32(t)
    assert (trunc.abs() <= t.abs()).all()  # truncation: towards zero, always
    assert torch.equal(t, kept)  # the input untouched
    with pytest.raises(TypeError):
        to_tf32(t.double())


@pytest.mark.parametrize("mode", MODES)
def test_a_linear_runs_its_three_matmuls_on_tf32_inputs_accumulating_in_fp32(mode):
    """forward tf32(x) tf32(W)^T + b; backward tf32(g) tf32(W) and tf32(g)^T tf32(x), each
    equal to float64 arithmetic on the rounded inputs within fp32 accumulation."""
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(48, 24)
    x = torch.randn(3, 5, 48, generator=gen).requires_grad_()
    g = torch.randn(3, 5, 24, generator=gen)
    with emulate_tf32(mode) as em:
        y = lin(x)
        y.backward(g)
    assert em.linears == 1 and not active()

    def r(t):
        return to_tf32(t.detach(), mode).double()

    want_y = r(x) @ r(lin.weight).t() + lin.bias.detach().double()
    want_gx = r(g) @ r(lin.weight)
    want_gw = r(g).reshape(-1, 24).t() @ r(x).reshape(-1, 48)
    for got, want in ((y, want_y), (x.grad, want_gx), (lin.weight.grad, want_gw)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.bias.grad, g.sum((0, 1)), rtol=1e-6, atol=1e-6)
    # and that is not fp32's: every result moved by TF32's rounding
    x2 = x.detach().clone().requires_grad_()
    lin.zero_grad()
    lin(x2).backward(g)
    for got, exact in ((y, lin(x2)), (x.grad, x2.grad)):
        assert (got - exact).abs().max() > 1e-4 * exact.abs().max()


def test_every_fp32_linear_of_gpt2_goes_through_it_and_nothing_else_does():
    """Per forward: 4 Linears a block and the head's logits (through the tied wte); none
    under bf16 autocast (no fp32 matmul to make TF32), none when suspended or outside."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=512)
    model = GPT(cfg, seed=1)
    idx = torch.randint(0, 512, (2, 16))
    with emulate_tf32() as em:
        _, loss = model(idx, idx)
        loss.backward()
        assert em.linears == 4 * cfg.n_layer + 1
        with suspended():
            model(idx, idx)
            assert not active()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx)
        assert em.linears == 4 * cfg.n_layer + 1 and active()
    assert not active()
    # the head's gradient of the tied weight is TF32's: it differs from the fp32 one
    tf32_grad = model.wte.weight.grad.clone()
    model.zero_grad()
    model(idx, idx)[1].backward()
    assert not torch.equal(tf32_grad, model.wte.weight.grad)


# -- the tolerance, and who is held to it ----------------------------------------------------


def test_policy_key_and_tf32_in_effect():
    fp32, bf16c = Numerics(), Numerics(compute=Dtype.BF16)
    off = dataclasses.replace(fp32, tf32=False)
    assert tf32_in_effect(fp32, "cuda") and tf32_in_effect(Numerics(tf32=True), "cuda")
    assert not tf32_in_effect(off, "cuda") and not tf32_in_effect(fp32, "cpu")
    assert policy_key(fp32, 2) == "float32" and policy_key(fp32, 2, tf32=True) == "tf32"
    assert policy_key(fp32, 2, "float64", tf32=True) == "float64"  # TF32 is fp32's only
    # bf16 somewhere keeps its key: measured, its bounds hold TF32 matmuls with bf16
    # reductions (tests/oracle.py); under bf16 compute there is no fp32 matmul at all
    assert policy_key(bf16c, 4, tf32=True) == "bf16-compute"
    assert policy_key(bf16c, 3, tf32=True) == "bf16"
    assert policy_key(Numerics(reduce=Dtype.BF16), 2, tf32=True) == "bf16"
    assert policy_key(POLICIES["bf16"], 2, tf32=True) == "bf16"
    # TF32's bounds are wider than fp32's in every field: used only where TF32 ran
    t, fp32_tol = TOL["tf32"], TOL["float32"]
    for f in dataclasses.fields(t):
        if "share" not in f.name and getattr(fp32_tol, f.name) is not None:
            assert getattr(t, f.name) >= getattr(fp32_tol, f.name), f.name


def test_the_reference_is_fp32_whatever_tolerance_it_is_held_to():
    text = fsdp(1, 1, THREE_UNITS)
    plain = reference_steps(text, 1)
    with emulate_tf32():  # computed, or found in the cache, exactly as outside
        ref = reference_steps(text, 1, tf32=True)
    assert plain.policy == "float32" and ref.policy == "tf32"
    assert ref[0] is plain[0]  # one computation: tf32 chooses the tolerance only
    assert reference_steps(text, 1).policy == "float32"


# -- the issue's cases: within the tf32 bound, outside fp32's ------------------------------------


@pytest.mark.parametrize("text", [DDP, FSDP], ids=["ddp", "fsdp"])
def test_cuda_texts_under_emulated_tf32_are_within_the_tf32_bound_not_fp32s(world1, text):
    with emulate_tf32():  # the reference stays fp32 even asked for in here
        ref = reference_steps(text, 2, tf32=True)
    got, em = run_world1(text, 2)
    spec = compile_text(text, "tf32.sched", Overrides(steps=2)).spec
    assert em.linears == 2 * spec.accum * (4 * spec.model.n_layer + 1)  # every Linear, every step
    assert ref.policy == "tf32"
    assert_matches(SimpleNamespace(steps=got), ref)  # the policy's tolerance: "tf32"
    for i, (g, r) in enumerate(zip(got, ref)):
        _assert_step(g, r, "tf32", "reference", first=i == 0)
        with pytest.raises(AssertionError):
            _assert_step(g, r, "float32", "reference", first=i == 0)


def test_two_spawned_ranks_under_emulated_tf32_are_within_the_tf32_bound(pool):
    text = fsdp(2, 2, THREE_UNITS)
    out = pool.run(text, 2, 2, tf32="truncate")
    assert out.linears > 0
    ref = reference_steps(text, 2, tf32=True)
    for i, (g, r) in enumerate(zip(out.steps, ref)):
        _assert_step(g, r, "tf32", "reference", first=i == 0)
