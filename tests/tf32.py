"""TF32 matmuls emulated on a CPU, for holding a CUDA run (TF32 on by default) to the fp32
CPU reference with a tolerance that has been measured (tests/oracle.py, TOL["tf32"]).

What a TF32 matmul does. With `torch.backends.cuda.matmul.allow_tf32` (schedc's
`set_tf32`, on unless the schedule says `tf32 off`) cuBLAS runs an fp32 GEMM on tensor
cores: each input element keeps its sign, its 8-bit exponent and the top 10 of its 23
mantissa bits (19 bits), the products are exact in the tensor core and accumulated in
fp32. PyTorch's notes on numerical accuracy (docs/source/notes/numerical_accuracy.rst,
its TF32 section) say that "only the first 10 bits of the input mantissa are read": the
tensor core takes fp32 registers and ignores the low 13 bits, a truncation (relative error
below 2^-10, always towards zero). A kernel may round first
(PTX `cvt.rna.tf32.f32`, round to nearest with ties away from zero, as CUTLASS and
Triton do before their TF32 `mma`; relative error at most 2^-11, unbiased), and which
cuBLAS does for a given GEMM is not documented. `emulate_tf32()` truncates by default, the
worse case: twice the rounding's bound, and biased (every product shrinks, so a dot
product's result is scaled by about 1 - 2^-10 on top of the random part that rounding
alone has). `emulate_tf32("round")` emulates the kernel that rounds; TOL["tf32"] was
measured with both (the first step is worse truncated; after it, chance decides).

What is emulated. Every fp32 `torch.nn.functional.linear` (each nn.Linear in the blocks;
the head's logits, `self.lm_head(h)`, an nn.Linear whose weight is the tied wte.weight)
becomes a Linear whose three matmuls see TF32 inputs, accumulation in fp32:

    forward      y      = tf32(x) @ tf32(W)^T + b
    backward     grad_x = tf32(g) @ tf32(W)
                 grad_W = tf32(g)^T @ tf32(x)        (g: the gradient of y)
                 grad_b = sum of g                   (no matmul: exact fp32, as on a GPU)

It patches the attribute `torch.nn.functional.linear` for the context's duration, which is
what nn.Linear.forward and schedc/model/gpt2.py call at run time (`F.linear`), so it works
wherever those run in this process: a whole-model forward, and schedc's executor, which cuts the model per layer and calls each layer's forward and
`autograd.backward` itself (the patched Linear is an autograd.Function; its backward runs
wherever autograd runs it). Rank processes enter it themselves (tests/pool.py's workers
with `Pool.run(..., tf32=mode)`). The oracle's reference never runs under it
(tests/oracle.py computes it inside `suspended()`): it is fp32.
A Linear under autocast, or on non-fp32 tensors, is left alone: TF32 applies to fp32
matmuls only, and under bf16 autocast GPT-2 has none.

What is not. F.scaled_dot_product_attention (the Q K^T and P V matmuls inside it), the
chunked head (`loss chunk N`: ChunkedLinearCE's matmuls are torch.mm / addmm, not
F.linear) and anything under `compile on` keep exact fp32 here. On a GPU, fp32 SDPA goes
to the memory-efficient kernel (flash and cuDNN attention take 16-bit inputs only), whose fp32 GEMMs on sm80 and later are CUTLASS's
OpMultiplyAddFastF32, 3xTF32, close to fp32 whatever allow_tf32 says
(aten/src/ATen/native/transformers/cuda/mem_eff_attention/gemm_kernel_utils.h,
DefaultGemmType<ArchTag >= 80, float>); its summation order (an online softmax) differs
from the CPU's, an fp32-sized difference, far inside TF32's. The tolerance keeps a margin
for it (tests/oracle.py); a GPU run compared with the reference under TOL["tf32"] tells
whether the margin is enough, and its measured maxima beside the emulation's say how much
of the difference is TF32 (the emulation reproduces TF32's inputs, not cuBLAS's order of
summation).

`python3 -m tests.tf32` measures the emulated executor against the fp32 reference over
the cases tests/oracle.py's TF32 paragraph reports (worlds 1, 2 and 4, on gloo ranks).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch.nn import functional as F

MODES = ("truncate", "round")
_KEEP = -(1 << 13)  # 0xFFFFE000 as int32: sign, exponent and the top 10 mantissa bits
_HALF = 1 << 12  # half a TF32 ulp, in the low bits an fp32 value's mantissa drops


def to_tf32(t: torch.Tensor, mode: str = "truncate") -> torch.Tensor:
    """t's fp32 values with 10 mantissa bits: the low 13 dropped ("truncate", towards zero),
    or rounded to nearest, ties away from zero ("round", PTX cvt.rna.tf32.f32). A new
    tensor (fp32, t's shape); t itself is never written."""
    if t.dtype != torch.float32:
        raise TypeError(f"TF32 rounds fp32 values, not {t.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    bits = t.view(torch.int32)  # same item size: a view whatever t's strides
    if mode == "round":
        bits = bits + _HALF  # a carry into the exponent is the round-up of a mantissa 1.11..1
    return (bits & _KEEP).view(torch.float32)


@dataclass
class Emulation:
    """One `emulate_tf32()` context: its mode and how many Linear forwards it turned TF32
    (a test can check the model really went through it)."""

    mode: str
    linears: int = 0


_ORIGINAL_LINEAR = F.linear
_active: list[Emulation] = []  # the innermost last


class _TF32Linear(torch.autograd.Function):
    """F.linear with TF32 inputs to its three matmuls (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        # the tensors an ordinary Linear saves: FSDP's gathered weights are views whose
        # storage is freed after forward and gathered again before backward
        ctx.save_for_backward(x, weight)
        ctx.mode, ctx.has_bias = mode, bias is not None
        return _ORIGINAL_LINEAR(to_tf32(x, mode), to_tf32(weight, mode), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mode, out = ctx.mode, grad.size(-1)
        g = to_tf32(grad.contiguous(), mode)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ to_tf32(weight, mode)  # (..., out) @ (out, in)
        if ctx.needs_input_grad[1]:
            rows = to_tf32(x, mode).reshape(-1, x.size(-1))
            grad_w = g.reshape(-1, out).t() @ rows  # (out, rows) @ (rows, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, out).sum(0)
        return grad_x, grad_w, grad_b, None


def _linear(input, weight, bias=None):
    em = _active[-1] if _active else None
    fp32 = input.dtype == weight.dtype == torch.float32 and (
        bias is None or bias.dtype == torch.float32
    )
    if em is None or not fp32 or torch.is_autocast_enabled(input.device.type):
        return _ORIGINAL_LINEAR(input, weight, bias)
    em.linears += 1
    return _TF32Linear.apply(input, weight, bias, em.mode)


def _install(stack: list[Emulation]) -> None:
    _active[:] = stack
    F.linear = _linear if stack else _ORIGINAL_LINEAR


@contextlib.contextmanager
def emulate_tf32(mode: str = "truncate"):
    """Every fp32 F.linear in this process runs on emulated TF32 inputs while inside
    (module docstring); yields the Emulation, which counts the Linear forwards it changed.
    Nests (the innermost mode applies); a process entering it twice in threads is not
    supported (the patch is process-wide, like any attribute of torch)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    before = list(_active)
    em = Emulation(mode)
    _install([*before, em])
    try:
        yield em
    finally:
        _install(before)


@contextlib.contextmanager
def suspended():
    """Exact fp32 again inside, emulation or not (the oracle's reference is fp32: it must
    not become TF32 because a test computed it first inside `emulate_tf32`)."""
    before = list(_active)
    _install([])
    try:
        yield
    finally:
        _install(before)


def active() -> bool:
    return bool(_active)


# -- the measurement behind TOL["tf32"] --------------------------------------------------------


def _excess(got: dict, want: dict, rtol: float) -> torch.Tensor:
    """|got - want| - rtol |want| for every element of every tensor, flattened."""
    return torch.cat([((got[n] - w).abs() - rtol * w.abs()).flatten() for n, w in want.items()])


GRAD_RTOLS = (0.0, 1e-3, 5e-3, 1e-2, 2e-2)


def step_errors(got, want, param_rtol: float = 1e-5) -> dict:
    """One step's differences from the reference: loss and gradient norm (relative);
    gradients beyond each of GRAD_RTOLS (max, and the 99% quantile); parameters beyond
    param_rtol in units of lr (max, 99.9% and 99% quantiles)."""
    out = {
        "loss": abs(got.loss - want.loss) / abs(want.loss),
        "norm": abs(got.grad_norm - want.grad_norm) / want.grad_norm,
    }
    for rtol in GRAD_RTOLS:
        g = _excess(got.grads, want.grads, rtol).double()
        out[f"grad@{rtol:g}"] = g.max().item()
        out[f"grad99@{rtol:g}"] = g.quantile(0.99).item()
    p = _excess(got.params, want.params, param_rtol).double() / want.lr
    out["param"] = p.max().item()
    out["param999"] = p.quantile(0.999).item()
    out["param99"] = p.quantile(0.99).item()
    return out


def measure_cases() -> dict[str, str]:
    """Fixed cases: worlds 1, 2 and 4, DDP and FSDP, a few partitions, micro-step counts,
    no_sync on and off, test_cuda.py's two texts, and fp32-compute bf16 reductions (TF32
    with a bf16 policy, held to "bf16")."""
    from tests.exec.test_cuda import DDP, FSDP
    from tests.exec.test_equivalence import (
        CAP,
        ONE_BUCKET,
        PER_PARAM,
        THREE_UNITS,
        TWO_BUCKETS,
        TWO_UNITS,
        ddp,
        fsdp,
    )

    out = {"cuda-ddp": DDP, "cuda-fsdp": FSDP}
    for w in (1, 2, 4):
        out[f"ddp-w{w}-two-buckets-k2"] = ddp(w, 2, TWO_BUCKETS)
        out[f"ddp-w{w}-one-bucket-k1-sync"] = ddp(w, 1, ONE_BUCKET, no_sync=False)
        out[f"ddp-w{w}-cap-k3"] = ddp(w, 3, CAP, micro=1)
        out[f"ddp-w{w}-per-param-k4-sync"] = ddp(w, 4, PER_PARAM, no_sync=False, micro=1)
        out[f"fsdp-w{w}-three-units-k2"] = fsdp(w, 2, THREE_UNITS)
        out[f"fsdp-w{w}-three-units-p2-k3-no-sync"] = fsdp(
            w, 3, THREE_UNITS, fwd=2, bwd=2, no_sync=True, micro=1
        )
        out[f"fsdp-w{w}-two-units-p0-k1-no-reshard"] = fsdp(
            w, 1, TWO_UNITS, fwd=0, bwd=0, reshard=False
        )
        out[f"fsdp-w{w}-two-units-k4-no-sync"] = fsdp(w, 4, TWO_UNITS, no_sync=True, micro=1)
    for w in (2, 4):
        out[f"ddp-w{w}-reduce-bf16"] = ddp(w, 2, TWO_BUCKETS) + "precision { reduce = bf16 }\n"
        out[f"fsdp-w{w}-reduce-bf16"] = fsdp(w, 2, THREE_UNITS) + "precision { reduce = bf16 }\n"
    return out


def generated_cases(n: int) -> dict[str, str]:
    """n fp32 schedules from tests/strategies.py's cases() (worlds 1, 2 and 4),
    derandomized: the same ones every run."""
    from hypothesis import HealthCheck, given, settings

    from tests.strategies import cases

    texts: list[str] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(worlds=(1, 2, 4), max_k=4))
    def collect(case):
        if len(texts) < n:
            texts.append(case.text())

    collect()
    return {f"gen{i}": t for i, t in enumerate(dict.fromkeys(texts))}


def main(argv: list[str]) -> None:
    """`python3 -m tests.tf32 [truncate|round] [N] [fp32|reduce-bf16]`: run the fixed cases
    and N generated ones (their fp32 texts, or each with `precision { reduce = bf16 }`:
    TF32 matmuls and bf16 reductions, held to "bf16") under the emulation on the pool's gloo
    ranks, 3 steps, against the fp32 reference. Prints each step's errors, the maxima per
    policy and step (with the case that made each), and every step outside its TOL."""
    import time

    from schedc.compiler import compile_text
    from schedc.lang.resolve import Overrides
    from tests.oracle import _assert_step, reference_steps
    from tests.pool import Pool

    mode = argv[0] if argv else "truncate"
    n_gen = int(argv[1]) if len(argv) > 1 else 24
    variant = argv[2] if len(argv) > 2 else "fp32"
    steps = 3
    todo = {**measure_cases(), **generated_cases(n_gen)}
    if variant == "reduce-bf16":
        todo = {
            f"{k}-reduce-bf16": t + "precision { reduce = bf16 }\n"
            for k, t in todo.items()
            if "precision" not in t
        }
    t0, pool = time.monotonic(), Pool()
    worst: dict[tuple[str, int], dict[str, tuple[float, str]]] = {}
    outside: list[str] = []
    try:
        for name, text in todo.items():
            spec = compile_text(text, "m.sched", Overrides(steps=steps)).spec
            got = pool.run(text, spec.world, steps, tf32=mode, timeout=120).steps
            ref = reference_steps(text, steps, tf32=True)
            for i, (g, r) in enumerate(zip(got, ref)):
                e = step_errors(g, r)
                line = " ".join(f"{k} {v:.3g}" for k, v in e.items())
                print(f"{name} w{spec.world} {ref.policy} step {i}: {line}", flush=True)
                acc = worst.setdefault((ref.policy, i), {})
                for k, v in e.items():
                    acc[k] = max(acc.get(k, (float("-inf"), "")), (v, name))
                try:
                    _assert_step(g, r, ref.policy, "reference", first=i == 0)
                except AssertionError as err:
                    outside.append(f"{name} step {i}: {str(err).splitlines()[0][:300]}")
    finally:
        pool.close()
    print(f"{len(todo)} cases, {steps} steps, mode {mode}, {time.monotonic() - t0:.0f} s")
    for (key, i), acc in sorted(worst.items()):
        line = " ".join(f"{k} {v:.3g} ({case})" for k, (v, case) in acc.items())
        print(f"MAX {key} step {i}: {line}")
    print(f"{len(outside)} steps outside their tolerance")
    for line in outside:
        print("OUTSIDE", line)


if __name__ == "__main__":
    main(sys.argv[1:])
