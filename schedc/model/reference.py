"""The single-process training step: the oracle every schedule is tested against.

One optimizer step is what one GPU does with gradient accumulation over the step's global
batch of S sequences (see `schedc.model.batching`):

    for each of the k = S/B micro-batches, in order:  loss_j = CE(model(x_j), y_j)
                                                       backward(loss_j / k)
    grads  = sum_j grad(loss_j) / k  = gradient of the mean loss over the global batch
    norm   = ||grads||_2 over all parameters; grads *= clip_coef(norm, clip) if clip > 0
    AdamW at lr_at(step), decaying matrices and embeddings only

A schedule that splits the same S sequences over D ranks and k' waves must reproduce
`StepResult.grads` and `StepResult.params` (to fp32 rounding; exactly in float64 up to
summation order).

A precision policy (schedc.ir.spec.Numerics, passed here as torch dtypes: this layer does
not import the compiler's) runs the same way: `compute` is the autocast dtype of each
micro-batch's forward (its backward follows it; the loss is fp32); `param_dtype` (FSDP's
gather dtype) computes with the master weights cast to it, so each micro-batch's gradient is
the one for those rounded weights, accumulated in fp32. The reduce dtype has no
single-process counterpart (one process sums nothing across ranks); tests/oracle.py bounds
what a bf16 reduction may change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call
from torch.optim.adam import adam

from schedc.model.arch import GPTConfig
from schedc.model.batching import micro_steps
from schedc.model.config import OptimConfig
from schedc.model.data import GlobalBatches
from schedc.model.gpt2 import GPT


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced."""

    step: int
    loss: float
    """Mean of the micro-batch losses: the mean cross-entropy over the global batch."""
    lr: float
    grad_norm: float
    """Global L2 norm of the accumulated gradient, before clipping."""
    grads: dict[str, torch.Tensor]
    """Accumulated gradient per parameter name, before clipping."""
    params: dict[str, torch.Tensor]
    """Parameters after the update."""


def init_model(config: GPTConfig, seed: int, dtype: torch.dtype = torch.float32, **options) -> GPT:
    """A freshly initialised model; the same seed gives the same weights in any dtype.
    `options`: GPT's own (loss_chunk, embed_into_grad, loss_scale)."""
    return GPT(config, seed=seed, **options).to(dtype)


def _undecorated(method):
    """torch's own body of an Optimizer method that torch._disable_dynamo wraps (the wrapper
    imports torch._dynamo on first call); the method itself where a torch has no such body."""
    return getattr(method, "__wrapped__", method)


class AdamW(torch.optim.AdamW):
    """torch's fused AdamW, without the 1.3 s torch.optim spends importing torch._dynamo.

    torch.optim's step wrapper imports torch._dynamo to mark a graph break, and its
    bookkeeping methods import it to disable it: 1.3 s of CPU in every process that builds
    an optimizer, a third of a small run's start on each rank, for a compiler schedc never
    runs on an optimizer. Here `step` calls torch's functional fused AdamW (the kernel
    `torch.optim.AdamW.step` reaches) on the same state, made the same way on first use (a
    float32 `step` scalar on the parameter's device, zero moments), honouring `found_inf` and
    `grad_scale` as torch's step does; the bookkeeping methods are torch's bodies called
    directly. `tests/model/test_reference.py` holds it bitwise to torch.optim.AdamW, state
    dict included, and checks that a process using it never imports torch._dynamo.
    """

    def __init__(self, params, **kwargs) -> None:
        if not kwargs.get("fused") or kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("schedc's AdamW is torch's fused one, without amsgrad or maximize")
        super().__init__(params, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        _undecorated(torch.optim.Optimizer.add_param_group)(self, param_group)

    def state_dict(self):
        return _undecorated(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict) -> None:
        _undecorated(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _undecorated(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "schedc's AdamW takes no closure"
        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adam(
                params,
                grads,
                avgs,
                sqs,
                [],
                steps,
                fused=True,
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        return None


def make_adamw(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    opt: OptimConfig,
    kind: type[torch.optim.AdamW] = AdamW,
) -> torch.optim.AdamW:
    """AdamW with two groups, decay (dim >= 2) then no decay, each in the order given.

    The order fixes the layout of the optimizer state, so callers that pass parameters in
    the same order (arch.py's) get comparable optimizers. `kind`: schedc's AdamW, or the
    benchmarks' baselines' torch.optim.AdamW (the same kernel, as users run it).
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in named_params:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return adamw_groups(decay, no_decay, opt, kind)


def adamw_groups(
    decay: list, no_decay: list, opt: OptimConfig, kind: type[torch.optim.AdamW] = AdamW
) -> torch.optim.AdamW:
    """AdamW over explicit groups: `decay` gets opt.weight_decay, `no_decay` none.

    FSDP's flat shards are 1-D whatever they hold, so it names its groups itself.
    """
    groups = [
        {"params": decay, "weight_decay": opt.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return kind(
        [g for g in groups if g["params"]],
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        **adamw_impl((decay + no_decay)[0].device if decay or no_decay else None),
    )


def adamw_impl(device: torch.device | None) -> dict[str, bool]:
    """Which AdamW kernels: fused, on CUDA and on a CPU alike (one kernel for all parameters,
    as build-nanogpt uses on CUDA).

    Fused is what lets an update be skipped on the device: its `found_inf` (the attribute
    `optimizer.found_inf`, as torch.amp.GradScaler sets it) makes the kernel leave the
    parameters and moments alone and takes the step count back, so the executor never reads
    a loss or a norm on the host before the update is enqueued. On this repository's CPUs
    it is also 4.7x faster than foreach for GPT-2-sized tensors (8 x 2M elements: 19.8 vs
    92.2 ms) and allocates no sqrt(v) temporaries. The executor and the reference both build
    their optimizer here, so they run the same arithmetic and stay bitwise comparable.
    """
    return {"fused": True}


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of a set of gradients, as torch.nn.utils.clip_grad_norm_ computes it:
    one norm per tensor (`torch._foreach_norm`), then the norm of those. A device tensor:
    nothing is read on the host."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads))))


def clip_coef(total_norm, max_norm: float):
    """Factor that scales gradients of norm `total_norm` to at most `max_norm`.

    The formula of torch.nn.utils.clip_grad_norm_; works on floats and tensors alike.
    """
    coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


class Reference:
    """Single-process training on `batches`, `micro_seqs` sequences per micro-batch."""

    def __init__(
        self,
        model_cfg: GPTConfig,
        opt: OptimConfig,
        batches: GlobalBatches,
        micro_seqs: int,
        total_steps: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: str | torch.device = "cpu",
        compute: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        if batches.seq_len > model_cfg.block_size:
            raise ValueError(
                f"sequence length {batches.seq_len} exceeds block_size {model_cfg.block_size}"
            )
        self.accum = micro_steps(batches.global_seqs, micro_seqs, 1)
        self.opt = opt
        self.batches = batches
        self.micro_seqs = micro_seqs
        self.total_steps = total_steps
        self.device = torch.device(device)
        self.model = init_model(model_cfg, seed, dtype).to(self.device)
        self.named_params = list(self.model.named_parameters())
        self.optimizer = make_adamw(self.named_params, opt)
        self.step_index = 0
        self.compute = None if compute in (None, dtype) else compute
        self.param_dtype = None if param_dtype in (None, dtype) else param_dtype

    def _forward(self, x: torch.Tensor, y: torch.Tensor):
        """The model on one micro-batch under the policy: autocast in `compute`, and with
        `param_dtype` the weights cast to it (a differentiable cast: their gradient comes
        back to the fp32 parameters, where micro-batches accumulate)."""
        ctx = (
            torch.autocast(self.device.type, dtype=self.compute)
            if self.compute
            else contextlib.nullcontext()
        )
        with ctx:
            if self.param_dtype is None:
                return self.model(x, y)
            cast = {n: p.to(self.param_dtype) for n, p in self.named_params}
            return functional_call(self.model, cast, (x, y))  # ties lm_head to wte's cast

    def step(self, *, record: bool = True) -> StepResult:
        """Run the next optimizer step; `record=False` leaves grads and params empty."""
        step, k = self.step_index, self.accum
        self.model.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in range(k):
            x, y = self.batches.micro_batch(step, 0, micro, self.micro_seqs, 1)
            _, loss = self._forward(x.to(self.device), y.to(self.device))
            (loss / k).backward()  # summed over the k micro-batches: the mean loss's gradient
            loss_sum += loss.detach()

        grads = [_grad(p) for _, p in self.named_params]
        norm = global_grad_norm(grads)
        names = [n for n, _ in self.named_params]
        recorded = {n: g.detach().clone() for n, g in zip(names, grads)} if record else {}
        if self.opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, self.opt.clip))

        lr = self.opt.lr_at(step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step_index += 1

        params = {n: p.detach().clone() for n, p in self.named_params} if record else {}
        return StepResult(step, (loss_sum / k).item(), lr, norm.item(), recorded, params)


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's accumulated gradient: after a step's backward every parameter has one
    (each takes part in the loss)."""
    assert p.grad is not None, "a parameter the loss does not reach"
    return p.grad
