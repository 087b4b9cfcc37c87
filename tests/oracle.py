"""The single-process reference for a schedule, and the tolerances schedules are held to.

The reference runs the same micro-batch size as the schedule, so every micro-batch's
gradient is computed by the same kernels on the same data; what differs is the order of
summation (across ranks in the collective, within a rank by accumulation), and whatever
AdamW does with those last-bit differences. Measured on the fixed cases of
tests/exec/test_equivalence.py over 3 steps: gradients <= 3e-8 absolute, parameters
<= 7e-5 x lr after the first step and <= 6e-4 x lr after the third.

An isolated element can go further: AdamW divides by sqrt(v) + eps, so where an
element's gradient is near eps (1e-8) a last-bit difference in it moves its update by a
visible fraction of lr (measured: 1 element in 4096 at 1.9e-3 x lr; across micro-batch
sizes up to 7.5e-3 x lr). World 3 is worse, because averaging divides by 3, which
rounds: over 300 generated schedules (tests/exec/test_properties.py) the worst element was
6.7e-2 x lr, at world 3, on a gradient of -1.3e-8; at worlds 1, 2 and 4, 7.5e-3 x lr.
In float64 the same elements stay within 5e-12 x lr. Hence two tiers for parameters:
every element within 1e-1 x lr, and at least 99.9% of them within 1e-3 x lr (measured:
at most 0.03% above it), so an error in the bulk (a missing weight decay moves most
elements by > 1e-3 x lr) cannot hide in the first tier.

After the first step the runs no longer start from identical parameters (those few
elements differ), so their gradients differ by more than summation order: over 300
generated schedules and 100 agreeing pairs, up to 2.1e-5 beyond rtol 1e-5 in one
element, and up to 0.2% of elements beyond atol 1e-6 (first step: at most 6.8e-8). A
parameter may differ by 1e-1 x lr (1e-4 at the tests' lr of 1e-3), and with curvature
of order one a gradient moves by about as much. So gradients are held to the tight
tolerance everywhere on the first step, and after it every element within 1e-4 and 99%
of them within the tight one (a wrong scale, a missed reduction or a gradient never
zeroed moves nearly every element by far more).

fp32: gradients rtol 1e-5, atol 1e-6 (after the first step: atol 1e-4 for all elements,
1e-6 for 99% of them); parameters rtol 1e-5, atol 1e-1 x lr for all elements and
1e-3 x lr for 99.9% of them.
float64: gradients rtol 1e-10, atol 1e-13; parameters rtol 1e-10, atol 1e-9 x lr.

A chunked loss (`loss chunk N`, schedc/model/gpt2.py ChunkedLinearCE) is held to the same
fp32 tolerances against the unchunked reference: its loss, grad h and so every block's
gradient are the same kernels row by row, but the head's part of the tied wte gradient is
a sum of per-chunk matmuls instead of one, not bitwise the unchunked one (measured on
tests/exec/test_loss_chunk.py's nano cases, 64 tokens in chunks of 24: max |diff| 1.1e-8
in wte.weight's gradient, inside atol 1e-6). Under bf16 compute each chunk's part is
rounded to bf16 on its own (relative difference of the head's wte gradient 2.4e-3 in
tests/model/test_chunked_loss.py), which `Numerics.effective` counts as a difference.

(An earlier single tier, 2e-2 x lr for every element, hid FSDP applying no weight decay,
a 2e-3 x lr effect per step; float64 caught it. Tolerances here are the measured error
with a small margin, not a guess.)

Precision policies (issue #13). The reference runs the schedule's compute dtype (autocast)
and, for FSDP, its gather dtype (the weights cast to it); see schedc/model/reference.py.
Measured with the property suite's cases() (60 draws per policy and strategy, DDP: compute,
reduce; FSDP: compute, gather, reduce; 251 distinct schedules, 473 steps, worlds 1-4):

bf16 compute alone, at worlds 1, 2 and 4: each micro-batch's gradient is computed by the
same bf16 kernels on the same data as the reference's, and the schedule's loss scale 1/k
differs from the reference's 1/(kD) by a power of two, which commutes with rounding; so the
first step differs only in fp32 summation order, as in fp32 (measured: gradients 1.0e-9
beyond rtol 1e-5, parameters 2.2e-3 x lr; at world 1 FSDP is bitwise the reference and
DDP within 7.5e-9: it adds the tied weight's two gradients into the bucket one after the
other, the reference adds their sum). After it, parameters that differ in their last fp32
bit can round to different bf16 values, which a bf16 forward turns into a 2^-8 difference:
measured 9.2e-5 beyond rtol 1e-5 for every element, 3.2e-6 for 99% of them; parameters
0.35 x lr for every element, 3.2e-2 x lr for 99.9%. Tolerance "bf16-compute": the fp32
one on the first step, then gradients 2e-4 (every element) and 1e-5 (99%), parameters
1 x lr (every element) and 5e-2 x lr (99.9%), on both steps.

Everything else that rounds to bf16 differently from the reference ("bf16"):
* a bf16 reduction (DDP all-reduce, FSDP reduce-scatter). The reference sums in fp32; the
  schedule rounds each rank's share x_r/D to bf16 (relative error <= u = 2^-8) and gloo
  adds the D shares in bf16, rounding each of the D-1 partial sums (each <= sum|x_r|/D):
  |got - exact| <= D u m + O(u^2), m = (1/D) sum_r |x_r|, the mean size of one rank's
  contribution. Where the ranks agree in sign that is a relative error of D u (1.6% at
  D = 4); where they cancel it is absolute, in the scale of one rank's gradient. DDP with
  no_sync off re-reduces the bucket every micro-step (the average so far is rounded again),
  k reductions: k D u m. At world 1 it is the single rounding of each element (u).
* a bf16 gather: the weights are rounded as in the reference, and so are the unsharded
  gradients (bf16, as their parameters). Under no_sync they accumulate over the k
  micro-steps in bf16 (k - 1 roundings of a partial sum, <= (k - 1) u of it; FSDP2 would
  upcast them), where the reference accumulates in fp32; without no_sync each micro-step
  is reduced and then added in fp32, as in the reference (world 1: bitwise).
* bf16 compute at world 3: the schedule scales a micro-batch's loss by 1/k, backward runs
  in bf16, and the 1/3 is applied to the fp32 gradient; the reference scales the loss by
  1/(3k) before its bf16 backward. 1/3 does not commute with rounding: each bf16 op in the
  backward rounds differently, a u-sized relative error per op (as torch's own DDP, which
  divides after the backward, differs from one process).
AdamW's first update is lr x g/|g| elementwise, so an element whose gradient is smaller
than these errors can flip sign: its parameter moves by up to 2 lr. Measured (first step;
after it): gradients beyond rtol 2e-2 at most 9.4e-4; 5.3e-3; 99% of them beyond rtol 4e-3
at most 1.1e-4; 1.5e-4; parameters at most 2.0 lr; 3.25 lr, 99.9% within 1.6 lr; 2.0 lr,
99% within 1.0e-3 x lr; 5.1e-2 x lr; the loss 1.4e-16; 2.9e-5 relative, the gradient norm
2.2e-3; 1.7e-3. Tolerance "bf16": gradients rtol 2e-2, every element 1e-2, 99% within
3e-4; parameters every element 5 x lr, 99% within 1e-1 x lr; loss 1e-4 relative, gradient
norm 5e-3. Loose per element by nature, but a wrong scale (a missing 1/D: a bf16 result
never cast back; a missing 1/k) moves nearly every gradient by far more than 2e-2, and
fp32's tolerance still catches a reduction done in bf16 where the schedule says fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from schedc.compiler import compile_text
from schedc.lang.resolve import Overrides
from schedc.model.data import load_batches
from schedc.model.reference import Reference, StepResult


@dataclass(frozen=True)
class Tol:
    """The tolerances above, for one dtype."""

    grad_rtol: float
    grad_atol: float  # every element on the first step; the bulk after it
    grad_atol_later: float  # every element after the first step
    grad_share_later: float  # the bulk's share after the first step
    param_rtol: float
    param_atol: float  # x lr, every element
    param_bulk_atol: float  # x lr, the bulk
    param_share: float  # the bulk's share
    loss_rtol: float = 1e-5
    norm_rtol: float = 1e-4
    grad_atol_first: float | None = None  # every element on the first step, if not grad_atol
    grad_share_first: float = 1.0  # the share within grad_atol on the first step


TOL = {
    "float32": Tol(1e-5, 1e-6, 1e-4, 0.99, 1e-5, 1e-1, 1e-3, 0.999),
    "float64": Tol(1e-10, 1e-13, 1e-13, 1.0, 1e-10, 1e-9, 1e-9, 1.0),
    # bf16 compute at a power-of-two world: fp32's first step, bf16-rounded weights after it
    "bf16-compute": Tol(1e-5, 1e-5, 2e-4, 0.99, 1e-5, 1.0, 5e-2, 0.999, grad_atol_first=1e-6),
    # bf16 reductions, bf16 gathers, bf16 compute at world 3 (derived above)
    "bf16": Tol(
        2e-2,
        3e-4,
        1e-2,
        0.99,
        2e-2,
        5.0,
        1e-1,
        0.99,
        loss_rtol=1e-4,
        norm_rtol=5e-3,
        grad_atol_first=1e-2,
        grad_share_first=0.99,
    ),
}


class Steps(tuple):
    """The reference's steps, and the tolerance (a TOL key) the schedule's policy calls for."""

    policy: str = "float32"


def policy_key(numerics, world: int, dtype: str = "float32") -> str:
    """Which tolerance (a TOL key) a run is held to: the run's dtype for an fp32 policy,
    "bf16-compute" for bf16 compute alone at a power-of-two world, else "bf16"."""
    low = {f for f in ("compute", "gather", "reduce") if getattr(numerics, f).value == "bf16"}
    if not low:
        return dtype
    if low == {"compute"} and world & (world - 1) == 0:
        return "bf16-compute"
    return "bf16"


@lru_cache(maxsize=64)
def _reference(key) -> Steps:
    cfg, optim, data, T, S, B, seed, steps, dtype, numerics, fsdp, world = key
    batches = load_batches(data, T, S, cfg.vocab_size)
    low = {"fp32": None, "bf16": torch.bfloat16}
    # one thread, as every pool rank runs (tests/pool.py): a CPU matmul's summation order
    # depends on the thread count, and under bf16 that changes results by a bf16 ulp. The
    # suite's process may have more (an in-process `schedc run` sets cores / ranks).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = Reference(
            cfg,
            optim,
            batches,
            B,
            steps,
            seed,
            getattr(torch, dtype),
            compute=low[numerics.compute.value],
            param_dtype=low[numerics.gather.value] if fsdp else None,
        )
        out = Steps(ref.step() for _ in range(steps))
    finally:
        torch.set_num_threads(threads)
    out.policy = policy_key(numerics, world, dtype)
    return out


def reference_steps(text: str, steps: int, dtype: str = "float32") -> Steps:
    """What one process does with the schedule's global batch, micro-batch by micro-batch,
    under the schedule's precision policy (its reduce dtype has no counterpart here)."""
    spec = compile_text(text, "ref.sched", Overrides(steps=steps)).spec
    return _reference(
        (
            spec.model,
            spec.optim,
            spec.data,
            spec.seq_len,
            spec.seqs,
            spec.micro,
            spec.seed,
            steps,
            dtype,
            spec.numerics,
            spec.kind.value == "fsdp",
            spec.world,
        )
    )


def assert_matches(result, ref: tuple[StepResult, ...], dtype: str = "float32") -> None:
    """Every step's loss, gradients (before clipping) and parameters (after) equal the oracle,
    within the tolerance of the reference's policy (`dtype` for fp32 policies)."""
    assert len(result.steps) == len(ref)
    key = getattr(ref, "policy", dtype) if dtype == "float32" else dtype
    for i, (got, want) in enumerate(zip(result.steps, ref)):
        _assert_step(got, want, key, "reference", first=i == 0)


def assert_same_update(a, b, dtype: str = "float32") -> None:
    """Two runs (pool results) of schedules that agree made the same steps, within the
    same tolerances as against the oracle (each differs from it only in summation order)."""
    assert len(a.steps) == len(b.steps)
    for i, (got, want) in enumerate(zip(a.steps, b.steps)):
        _assert_step(got, want, dtype, "the other schedule", first=i == 0)


def _assert_step(got, want, dtype: str, other: str, first: bool) -> None:
    t, step = TOL[dtype], got.step
    assert abs(got.lr - want.lr) <= 1e-9 * want.lr, (step, got.lr, want.lr)
    assert abs(got.loss - want.loss) <= t.loss_rtol * abs(want.loss), (
        f"step {step}: loss {got.loss} vs {want.loss} ({other})"
    )
    assert abs(got.grad_norm - want.grad_norm) <= t.norm_rtol * want.grad_norm + 1e-6, (
        f"step {step}: grad norm {got.grad_norm} vs {want.grad_norm} ({other})"
    )
    assert got.grads.keys() == want.grads.keys()
    if first:
        g_atol, share = t.grad_atol_first or t.grad_atol, t.grad_share_first
    else:
        g_atol, share = t.grad_atol_later, t.grad_share_later
    _assert_tiers(
        "grad", got.grads, want.grads, t.grad_rtol, g_atol, t.grad_atol, share, step, other
    )
    _assert_tiers(
        "param",
        got.params,
        want.params,
        t.param_rtol,
        t.param_atol * want.lr,
        t.param_bulk_atol * want.lr,
        t.param_share,
        step,
        other,
    )


def _assert_tiers(what, got, want, rtol, atol, bulk_atol, share, step, other) -> None:
    """Every element within (rtol, atol); at least `share` of them within (rtol, bulk_atol)."""
    close = total = 0
    for name, w in want.items():
        torch.testing.assert_close(
            got[name],
            w,
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{what} {n} step {step} vs {other}: {m}",
        )
        err = (got[name] - w).abs() - rtol * w.abs()
        close += int((err <= bulk_atol).sum())
        total += w.numel()
    assert close >= share * total, (
        f"step {step}: only {close}/{total} {what} elements within {bulk_atol:.3g} of {other}"
    )
