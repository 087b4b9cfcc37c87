"""Flat buffers: DDP's gradient buckets and FSDP's sharded units.

DDP: each bucket is one flat fp32 buffer; every parameter's .grad is a view into it, so
backward accumulates straight into the buffer the all-reduce sends (no copy).

FSDP: each unit's parameters are laid out in one flat buffer, matrices first (weight
decay) then vectors, padded to a multiple of the world size D. Rank r owns the slice
[r*s, (r+1)*s), s = padded/D: the parameter shard, its gradient shard and the AdamW state
for it (16 bytes/param / D). The module parameters are permanent views of one full
buffer per unit whose *storage* is allocated by each all-gather and resized to zero by
each free (FSDP2's technique). That matters: autograd saves views of weights (a Linear
saves w.t()), so swapping `p.data` would neither free the memory nor let backward see a
re-gathered buffer; resizing the shared storage does both, and a use after the release
fails loudly (the storage is empty) instead of reading stale memory. The release comes a
little after the plan's free: once the stream that gathered the unit has waited for the
free (the executor's _reclaim, FSDP2's all-gather state), so the next gather reuses it.

Under a bf16 gather (FSDP2's param_dtype) the full buffer, and so the parameters the layers
compute with and the unsharded gradients autograd writes for them, are bf16; the shard, the
gradient shard and the AdamW state stay fp32. Gradients a unit receives from several
backward calls (the tied weight from head and embed; every micro-step of a step under
no_sync) accumulate in that bf16 buffer before the reduce-scatter, except that under
no_sync with a wider reduce dtype each micro-step's bf16 gradient is folded into an
accumulator in the reduce dtype once the unit's backward for it is done, as FSDP2 upcasts
(`accumulate`), so k micro-steps are summed in fp32, as the reference sums them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from schedc.ir.sizes import padded
from schedc.ir.spec import BucketSpec, UnitSpec
from schedc.model.arch import GPTConfig


class FlatBucket:
    """A DDP bucket: the flat gradient buffer its parameters' .grad views live in."""

    def __init__(self, spec: BucketSpec, params: dict[str, nn.Parameter]):
        self.name = spec.name
        self.params = [params[n] for n in spec.params]
        p0 = self.params[0]
        self.flat = torch.zeros(
            sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device
        )
        self.bind()

    def bind(self) -> None:
        """Point every parameter's .grad at its slice of the flat buffer."""
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = self.flat[off : off + n].view_as(p)
            off += n

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class FlatUnit:
    """An FSDP unit: one padded flat parameter, sharded over the ranks."""

    def __init__(
        self,
        spec: UnitSpec,
        cfg: GPTConfig,
        params: dict[str, nn.Parameter],
        rank: int,
        world: int,
        gather: torch.dtype | None = None,
        accumulate: torch.dtype | None = None,
    ):
        self.name = spec.name
        self.keep = spec.keep
        # (param, offset, numel, shape) in the order given (the bound plan's flat order,
        # cfg.flat_order): the shape is kept, since a freed parameter is empty
        self.layout: list[tuple[nn.Parameter, int, int, torch.Size]] = []
        self.runs: list[tuple[int, int, bool]] = []  # (start, end, decayed): AdamW's groups
        off = 0
        for name in spec.params:
            p, decay = params[name], cfg.param(name).decay
            self.layout.append((p, off, p.numel(), p.shape))
            if self.runs and self.runs[-1][2] == decay:
                self.runs[-1] = (self.runs[-1][0], off + p.numel(), decay)
            else:
                self.runs.append((off, off + p.numel(), decay))
            off += p.numel()
        self.numel = off
        self.padded = padded(self.numel, world)
        self.shard_len = self.padded // world
        self.rank, self.world = rank, world
        p0 = self.layout[0][0]
        self.dtype, self.device = p0.dtype, p0.device
        lo = rank * self.shard_len
        full = self.flatten()
        self.shard = full[lo : lo + self.shard_len].clone()  # this rank's parameters
        self.param_dtype = gather or self.dtype  # what is gathered and computed with
        if self.param_dtype != self.dtype:
            full = torch.empty(self.padded, dtype=self.param_dtype, device=self.device)
        # the gradient shard exists from the step's first reduce-scatter of this unit to the
        # update, as in FSDP2; between steps it holds no memory
        self.shard_grad: torch.Tensor | None = None
        self.full = full  # gathered while its storage is non-empty
        for p, off, n, shape in self.layout:
            p.data = full[off : off + n].view(shape)
        self.grads: dict[int, torch.Tensor] = {}  # unsharded gradients, by micro-step
        # no_sync's accumulator in a wider dtype than the gather's (FSDP2's upcast), if any
        self.accumulate = accumulate
        self.acc: torch.Tensor | None = None
        self._opt_params: tuple[list[nn.Parameter], list[nn.Parameter]] | None = None
        # told of every buffer this unit allocates or frees, by its name in ir/effects.py
        # (the executor's buffer log, which tests hold against the plan's lifetimes)
        self.log: Callable[[str, str], None] = _ignore
        self.release()

    def flatten(self) -> torch.Tensor:
        """The unit's current full parameters as one padded flat tensor (from the modules)."""
        full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for p, off, n, _ in self.layout:
            full[off : off + n].copy_(p.detach().reshape(-1))
        return full

    # gathered parameters ---------------------------------------------------------------

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def alloc_full(self) -> torch.Tensor:
        """Give the full buffer its storage back; the all-gather then writes into it."""
        self.full.untyped_storage().resize_(self.full_bytes)
        self.log("alloc", f"gathered[{self.name}]")
        return self.full

    def drop_grad_views(self) -> None:
        """The parameters stop pointing at an unsharded gradient (a free, before release)."""
        for p, _, _, _ in self.layout:
            p.grad = None

    def release(self) -> None:
        """Free the gathered parameters: the storage every view shares goes to zero bytes."""
        self.drop_grad_views()
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.log("free", f"gathered[{self.name}]")

    # gradients ---------------------------------------------------------------------------

    def grad_buffer(self, key: int) -> torch.Tensor:
        """The unsharded gradient `key` (a micro-step, or one key for all of them under
        no_sync), allocated zeroed at its first backward; the parameters' .grad now
        accumulate into it. One buffer per micro-step lets a reduce-scatter that a program
        delays past the next micro-step's backward still take exactly its own gradient."""
        if key not in self.grads:
            # the parameters' dtype: autograd accumulates into a .grad of its parameter's
            self.grads[key] = torch.zeros(self.padded, dtype=self.param_dtype, device=self.device)
            self.log("alloc", f"grad[{self.name}]@mb{key}")
        grad = self.grads[key]
        for p, off, n, shape in self.layout:
            p.grad = grad[off : off + n].view(shape)
        return grad

    def take_grad(self, key: int) -> torch.Tensor:
        """Hand the unsharded gradient `key` (the accumulator, when micro-steps fold into
        one) to a reduce-scatter and forget it."""
        for p, _, _, _ in self.layout:
            p.grad = None
        if self.accumulate is not None:
            if key in self.grads:
                self.fold(key)
            acc, self.acc = self.acc, None
            assert acc is not None, "a micro-step's gradient was folded into the accumulator"
            self.log("free", f"acc[{self.name}]")
            return acc
        self.log("free", f"grad[{self.name}]@mb{key}")
        return self.grads.pop(key)

    def fold(self, key: int, measure=None) -> None:
        """Add micro-step `key`'s unsharded gradient into the accumulator in the wider dtype
        (created by the first fold: the cast, FSDP2's `to_accumulated_grad_if_needed`) and
        free it; `measure` is called while both are live."""
        grad = self.grads[key]
        if self.acc is None:
            self.acc = grad.to(self.accumulate)
            self.log("alloc", f"acc[{self.name}]")
        else:
            self.acc.add_(grad)  # upcast inside the add
        if measure is not None:
            measure()
        for p, _, _, _ in self.layout:
            p.grad = None
        del self.grads[key]
        self.log("free", f"grad[{self.name}]@mb{key}")

    # the optimizer's view of the shard -----------------------------------------------------

    def optimizer_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(decay, no decay) parameters that alias this rank's shard and gradient shard.

        Made once: the optimizer keys its state by these objects.
        """
        if self._opt_params is None:
            self._opt_params = self._make_optimizer_params()
        return self._opt_params

    def _make_optimizer_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        lo, hi = self.rank * self.shard_len, (self.rank + 1) * self.shard_len
        out: tuple[list, list] = ([], [])
        for a, b, decay in self.runs:  # decay-first: one run of each, as lowered
            a, b = max(a, lo), min(b, hi)
            if a < b:
                out[0 if decay else 1].append(nn.Parameter(self.shard[a - lo : b - lo]))
        return out

    def new_shard_grad(self) -> torch.Tensor:
        """Allocate the gradient shard (uninitialised: the first reduce-scatter writes all of
        it) and point the optimizer's parameters' .grad at it."""
        grad = self.shard_grad = torch.empty_like(self.shard)
        for p in (p for group in self.optimizer_params() for p in group):
            a = (p.data_ptr() - self.shard.data_ptr()) // self.shard.element_size()
            p.grad = grad[a : a + p.numel()]
        self.log("alloc", f"shard_grad[{self.name}]")
        return grad

    def live_shard_grad(self) -> torch.Tensor:
        """The gradient shard, which exists from the step's first reduce-scatter of this unit
        to the update."""
        assert self.shard_grad is not None, f"no gradient shard of {self.name} this step"
        return self.shard_grad

    def drop_shard_grad(self) -> None:
        for p in (p for group in self.optimizer_params() for p in group):
            p.grad = None
        if self.shard_grad is not None:
            self.log("free", f"shard_grad[{self.name}]")
        self.shard_grad = None

    def assemble(self, flat: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """Split a full (gathered) flat tensor into per-parameter tensors."""
        return {p: flat[off : off + n].view(shape).clone() for p, off, n, shape in self.layout}

    @property
    def state_bytes(self) -> int:
        """Shard, gradient shard, Adam m and v: 16 bytes/param / D in fp32."""
        return 4 * self.shard_len * self.shard.element_size()


def _ignore(action: str, buffer: str) -> None:
    pass
