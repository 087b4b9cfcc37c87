"""The update of a step: the global gradient norm, clipping, the non-finite check and AdamW,
enqueued without reading anything on the host, and the step's loss and norm read after.

The GPU never idles waiting for the host before the update: the norm comes from the flat
gradient buffers (one norm per buffer, `torch._foreach_norm`), clipping is one foreach
multiply, and the non-finite check runs on the device, handed to fused AdamW as its
`found_inf` (a non-finite loss or norm leaves parameters, moments and step count as they
were). `finish` reads the loss and norm once the update is enqueued (on a GPU, after the
step's kernels ran): the log's values, and the non-finite verdict that every rank reaches
alike, since both values are global.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from schedc.errors import RunError
from schedc.exec.options import Comm, NonFinite, RunOptions, StepStats
from schedc.ir.spec import Spec
from schedc.model.reference import clip_coef


@dataclass
class Pending:
    """An update enqueued: its stats so far, and the loss and norm still on the device."""

    stats: StepStats
    loss: torch.Tensor
    norm: torch.Tensor


class Update:
    """The optimizer step over what the strategy holds (exec/strategies.py)."""

    def __init__(self, spec: Spec, comm: Comm, strategy, optimizer, opts: RunOptions):
        self.spec, self.comm, self.strategy = spec, comm, strategy
        self.optimizer, self.opts = optimizer, opts

    def __call__(self, step: int, losses: list[torch.Tensor], t0: float, keeps) -> Pending:
        """Enqueue step `step`'s update; `losses` are this rank's micro-steps' mean losses,
        `t0` the step's start (perf_counter), `keeps` the update's instruction's."""
        spec, opt, strategy = self.spec, self.spec.optim, self.strategy
        strategy.backend.drain()  # every reduction retired: shards and buckets hold final sums
        stats = StepStats(step, 0.0, opt.lr_at(step, spec.steps), 0.0, 0, 0)
        grads, norm = strategy.update_grads(), strategy.norm()
        if self.opts.record:
            stats.grads = strategy.full_tensors(grad=True)
        # the global loss: the mean over every rank's micro-steps
        loss = torch.stack(losses).double().sum() / spec.accum
        if self.comm.world > 1:
            dist.all_reduce(loss, group=self.comm.group)
            loss /= self.comm.world
        bad = nonfinite_flag(loss, norm)
        if opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, opt.clip))
        for group in self.optimizer.param_groups:
            group["lr"] = stats.lr
        self.optimizer.found_inf = bad  # fused AdamW skips the update where it is 1
        self.optimizer.step()
        stats.issue_ms = (time.perf_counter() - t0) * 1e3
        self.states = self.state_bytes()
        strategy.after_update(keeps)
        if self.opts.record:
            stats.params = strategy.full_tensors(grad=False)
        return Pending(stats, loss, norm)

    def finish(self, pending: Pending, losses: list[torch.Tensor]) -> StepStats:
        """The step's loss and norm on the host; a non-finite one stops the run (or, with
        --nonfinite skip, the update was skipped on the device and the step says why)."""
        stats = pending.stats
        stats.loss, stats.grad_norm = pending.loss.item(), pending.norm.item()
        judge_nonfinite(stats, losses, self.comm, self.opts.nonfinite)
        return stats

    def state_bytes(self, with_grads: bool = True) -> int:
        """Bytes of the model states, from the tensors themselves: parameters (FSDP: shards,
        and with `with_grads` their gradient shards), DDP's gradient buckets, AdamW's m and v
        (not the step count)."""
        held = self.strategy.states()
        if with_grads:  # FSDP's gradient shards (DDP's buckets are among the states)
            ids = {id(t) for t in held}
            held += [g for g in self.strategy.update_grads() if g is not None and id(g) not in ids]
        held += [
            t
            for st in self.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        return sum(t.untyped_storage().nbytes() for t in held)


def nonfinite_flag(loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the step's global loss or gradient norm is not finite, on the device: fused
    AdamW's `found_inf`, which leaves parameters, moments and step count as they were."""
    return (~(torch.isfinite(loss) & torch.isfinite(norm))).to(torch.float32)


def judge_nonfinite(
    stats: StepStats, losses: list[torch.Tensor], comm: Comm, nonfinite: NonFinite
) -> None:
    """After a step whose update was enqueued with `nonfinite_flag`: a non-finite loss or
    norm stops the run, every rank alike (both are global), or under --nonfinite skip marks
    the step skipped; either way naming the ranks and micro-steps whose loss was not finite
    (`losses`: this rank's)."""
    if math.isfinite(stats.loss) and math.isfinite(stats.grad_norm):
        return
    mine = [(comm.rank, j) for j, loss in enumerate(losses) if not torch.isfinite(loss)]
    bad = [x for part in comm.gather(mine) for x in part]
    if bad:
        where = ", ".join(f"rank {r} micro-step {j}" for r, j in bad)
        why = f"step {stats.step}: the loss is not finite in {where}"
    else:
        why = (
            f"step {stats.step}: the gradient norm is {stats.grad_norm} (the loss was "
            f"finite in every micro-step, so a backward produced it)"
        )
    if nonfinite is not NonFinite.SKIP:
        raise RunError(
            f"{why}; lower the learning rate, or run with --nonfinite skip to skip such updates"
        )
    stats.skipped = why  # the update was skipped on the device (found_inf)
