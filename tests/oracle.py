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

TF32. On CUDA schedc runs fp32 matmuls on TF32 unless the schedule says `tf32 off`
(`tf32_in_effect`); the reference stays fp32, and such a run is held to "tf32"
(`reference_steps(..., tf32=True)`, `policy_key`). tests/tf32.py emulates TF32 on a CPU: the
inputs of every Linear's three matmuls (forward, grad input, grad weight) keep 10 of fp32's
23 mantissa bits, accumulation in fp32; attention is not emulated (see there). Derivation:
a TF32 input is off by less than u = 2^-10 relative if the tensor core truncates (the
emulation's default, the worse case), 2^-11 if the kernel rounds first; bf16 keeps 7 bits
(2^-8), so TF32's input error is 1/4 of bf16's (1/8 rounded). An output y = sum x_i w_i is
then off by at most 2u sum |x_i w_i|: 2u relative where the terms agree in sign, absolute
in the scale of the terms where they cancel; truncation shrinks every product, so its error
is mostly a scaling of y by about 1 - u (measured: the first step's gradient norm 5.8e-4 to
8.3e-4 off, 1.3e-4 at most when rounded).
Unlike bf16 compute, the reference does not run the run's kernels: the forward itself
differs, so the first step differs by more than summation order. A gradient passes a few
such matmuls (the head's, each block's forward and backward): rtol 5e-3 = 5u, as bf16's
2e-2 is 5 x 2^-8, and an absolute term for the cancelling ones. AdamW's first update is
lr x g/|g|: an element whose gradient is below that error can flip, by up to 2 lr. Each
later update is at most about lr in either run (|m/sqrt(v)| <= 1.0003 at step 2 with betas
0.9, 0.95), so two runs differ by at most 2 sum_s lr_s: 4 lr after two steps at a constant
lr, 9.5 x the third step's lr after the suite's three (lr 1, 1, 0.53 x 1e-3). After the
first step those flips make the runs diverge as in fp32, from 2 lr instead of 0.1 lr (one
flipped element of a residual-stream bias, gradient -3.8e-5 vs an error of 6.7e-5, moved
wte.weight's gradient by 9.4e-3 a step later).
Measured with `python3 -m tests.tf32 truncate|round 400`: 346 fp32 schedules at worlds 1, 2
and 4 (116, 108, 122), 26 fixed (test_cuda.py's DDP and FSDP texts; at each world DDP with
two buckets, one bucket synced every micro-step, a byte cap, per-parameter buckets synced
every micro-step, FSDP with three units, prefetch 2 under no_sync, two units unresharded,
two units under no_sync; k = 1-4) and 320 derandomized draws of tests/strategies.py's
cases() (k <= 4), the executor on gloo ranks under the emulation against the fp32
reference, 3 steps, each mode (2,076 steps). First step; second; third, the worse mode:
gradients beyond rtol 5e-3 at most 1.8e-4; 9.4e-3; 5.4e-3, 99% of them within 4.7e-6;
3.5e-4; 2.2e-4; parameters (beyond rtol 1e-5) at most 2.0 lr; 2.15 lr; 4.05 lr, 99% within
1.4e-4 lr; 5.9e-2 lr; 1.5e-1 lr; the loss 4.6e-6; 5.9e-5; 7.0e-5 relative, the gradient norm
8.3e-4; 1.5e-3; 3.0e-3. Truncation is the worse on the first step (gradients 1.8e-4 vs
1.0e-4 rounded, the norm 8.3e-4 vs 1.3e-4); after it the worst case was a rounding run's
(the flip above), by chance. test_cuda.py's DDP text: parameters 1.97 lr; 1.01 lr
(truncated), 1.92 lr; 0.96 lr (rounded). Tolerance "tf32": gradients rtol 5e-3, on the first
step every element 5e-4, after it every element 2e-2 and 99% within 1e-3; parameters rtol
1e-5, every element 10 lr (the bound above, for up to three steps), 99% within 3e-1 lr; loss
2e-4 relative, gradient norm 6e-3: 2 to 3 times the measured maxima, a margin for what the
emulation leaves out. On a GPU fp32 attention runs 3xTF32 kernels (about fp32) in another
order than the CPU's, a difference of fp32's size, and cuBLAS sums in its own order; a GPU
run held to "tf32" with its maxima beside these says whether the margin holds. What it
still catches (tests/faults.py under the emulation, worlds 2 and 4): a missing 1/k (the
gradient norm doubles) and DDP reducing after the first micro-step; what it cannot: a
reduction done in bf16 where the schedule says fp32 is within it at world 2 (caught at
world 4 on the first step), as a 2^-8 rounding of each rank's share is within TF32's
error; fp32's tolerance catches it, so that check belongs to a CPU run or `tf32 off`.
bf16 somewhere and TF32 elsewhere keeps its bf16 key. Under bf16 compute no matmul is fp32
(autocast runs every Linear and the attention in bf16; a bf16 gather needs bf16 compute),
so TF32 changes nothing. That leaves fp32 compute with `precision { reduce = bf16 }`:
measured on the same 346 schedules with that line, both modes, against "bf16": every run
within it on its first two steps (gradients beyond rtol 2e-2 at most 5.2e-4; 8.0e-3, 99%
within 5.3e-6; 1.2e-4; parameters at most 2.0 lr; 3.8 lr; loss 3.5e-5, gradient norm
2.0e-3); on the third, 3 of the 692 runs had an element beyond its 5 lr (at most 7.2 lr),
inside the 9.5 lr AdamW allows there, as it allows bf16 alone (one of them without TF32:
3.75 lr)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from schedc.compiler import compile_text
from schedc.lang.resolve import Overrides
from schedc.model.data import load_batches
from schedc.model.reference import Reference, StepResult
from tests import tf32


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
    # fp32 matmuls on TF32 (derived and measured above)
    "tf32": Tol(
        5e-3,
        1e-3,
        2e-2,
        0.99,
        1e-5,
        10.0,
        3e-1,
        0.99,
        loss_rtol=2e-4,
        norm_rtol=6e-3,
        grad_atol_first=5e-4,
    ),
}


class Steps(tuple):
    """The reference's steps, and the tolerance (a TOL key) the schedule's policy calls for."""

    policy: str = "float32"


def policy_key(numerics, world: int, dtype: str = "float32", tf32: bool = False) -> str:
    """Which tolerance (a TOL key) a run is held to: the run's dtype for an fp32 policy
    ("tf32" when its fp32 matmuls ran on TF32: `tf32`, see tf32_in_effect), "bf16-compute"
    for bf16 compute alone at a power-of-two world, else "bf16" (TF32 or not: see above)."""
    low = {f for f in ("compute", "gather", "reduce") if getattr(numerics, f).value == "bf16"}
    if not low:
        return "tf32" if tf32 and dtype == "float32" else dtype
    if low == {"compute"} and world & (world - 1) == 0:
        return "bf16-compute"
    return "bf16"


def tf32_in_effect(numerics, device_type: str) -> bool:
    """Whether a run's fp32 matmuls run on TF32: on CUDA unless the schedule says `tf32 off`
    (schedc/exec/regions.py set_tf32), never on a CPU. For policy_key's `tf32`."""
    return device_type == "cuda" and numerics.tf32 is not False


@lru_cache(maxsize=64)
def _reference(key) -> tuple[StepResult, ...]:
    cfg, optim, data, T, S, B, seed, steps, dtype, numerics, fsdp = key
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
        with tf32.suspended():  # fp32 even when first asked for inside emulate_tf32()
            return tuple(ref.step() for _ in range(steps))
    finally:
        torch.set_num_threads(threads)


def reference_steps(text: str, steps: int, dtype: str = "float32", *, tf32: bool = False) -> Steps:
    """What one process does with the schedule's global batch, micro-batch by micro-batch,
    under the schedule's precision policy (its reduce dtype has no counterpart here), always
    on exact fp32 (or `dtype`) matmuls; held to the policy's tolerance, "tf32" where the run
    it is compared with had TF32 (`tf32`, see tf32_in_effect). The computed steps are cached
    by what determines them (not the world, nor tf32: they only choose the tolerance)."""
    spec = compile_text(text, "ref.sched", Overrides(steps=steps)).spec
    out = Steps(
        _reference(
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
                spec.sync.value == "fsdp",
            )
        )
    )
    # a pipeline without an fsdp block gathers nothing: its policy's gather dtype is moot
    numerics = spec.numerics.effective(spec.sync) if spec.pipeline else spec.numerics
    out.policy = policy_key(numerics, spec.dp, dtype, tf32)
    return out


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
