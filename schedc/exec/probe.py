"""Timed collectives of every kind and timed layers at other micro sizes, written into a
trace beside the step's ops.

    schedc run FILE.sched --trace out.json --probe

One calibration trace should price every schedule `schedc tune` compares, and a step's own
ops cannot say two things:
- **Collectives it does not run.** A DDP schedule runs no all-gather and an FSDP one no
  all-reduce; on gloo a byte of all-gather or reduce-scatter costs about 4x a byte of
  all-reduce, so neither kind predicts the other. Each rank times all-reduce, all-gather and
  reduce-scatter on the world's group at three sizes, twice each (nccl-tests' idea, fp32
  buffers), between barriers: events `probe KIND BYTES`, args kind, bytes (the full buffer:
  all-reduce's, all-gather's output, reduce-scatter's input), ranks and rep.
- **Micro sizes it does not run.** At one micro size a layer's FLOPs and the bytes of the
  parameter gradient its backward writes are in a fixed ratio (a linear layer's FLOPs are
  its parameters x tokens), so the fit cannot tell a per-token cost from a per-call one.
  On a CPU the per-call one is large: the head's backward writes the tied weight's whole
  (vocab, C) gradient whatever the batch (77 MB for the mini model, about 40 ms), once per
  micro-step, which makes micro 1 with k = 4 slower than micro 4 with k = 1. Each rank
  times the forward and the backward of `embed`, the first block and `head` on a fresh copy
  of the model (same policy, the same in-place gradients into existing .grad buffers as the
  executor's), at micro 1 and at the schedule's micro size (2 when that is 1), once to warm
  up then REPS times: events `probe fwd[LAYER] micro M`, args kind (fwd or bwd), layer,
  micro, tokens and rep.
Every timing is one Chrome "X" event on a `probe` thread, category `probe`, taken before
step 0 with every rank doing the same work at once (as in a step, the ranks share the
cores). schedc/analysis/probes.py `probes` and `compute_probes` read them back; calibrate fits a
collective kind the schedule's ops lack from the first, and adds the second to its compute
points.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import probe_event, thread_events
from schedc.model.gpt2 import GPT

SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes of the full buffer
KINDS = ("allreduce", "allgather", "reducescatter")
REPS = 2


def track(rank: int, tid: int) -> list[dict]:
    """The `probe` thread's metadata events."""
    return thread_events(rank, tid, "probe", sort=tid)


def probe_collectives(group, rank: int, world: int, device: torch.device, tid: int) -> list[dict]:
    """The collective probe's trace events on this rank (every rank of `group` must call it)."""
    events = []
    for kind in KINDS:
        for size in SIZES:
            numel = size // 4 // world * world  # a whole shard per rank
            full = torch.ones(numel, device=device)
            shard = torch.ones(numel // world, device=device)
            for rep in range(REPS):
                dist.barrier(group=group)
                _sync(device)
                t0 = time.perf_counter_ns()
                if kind == "allreduce":
                    dist.all_reduce(full, group=group)
                elif kind == "allgather":
                    dist.all_gather_into_tensor(full, shard, group=group)
                else:
                    dist.reduce_scatter_tensor(shard, full, group=group)
                _sync(device)
                t1 = time.perf_counter_ns()
                args = {"kind": kind, "bytes": numel * 4, "ranks": world, "rep": rep}
                name = f"probe {kind} {numel * 4}"
                events.append(probe_event(name, rank, tid, t0 / 1e3, (t1 - t0) / 1e3, args))
    dist.barrier(group=group)
    return events


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


COMPUTE_LAYERS = ("embed", "h.0", "head")  # every block is the same: one stands for all


def probe_micros(micro: int) -> tuple[int, ...]:
    """The micro sizes the compute probe times: 1 and the schedule's own (2 when it is 1)."""
    return (1, micro if micro > 1 else 2)


def probe_compute(
    model: GPT,
    seq_len: int,
    micros: tuple[int, ...],
    autocast: torch.dtype | None,
    device: torch.device,
    rank: int,
    tid: int,
    group=False,
) -> list[dict]:
    """The compute probe's trace events on this rank: the forward and the backward of each
    of COMPUTE_LAYERS at each micro size. `model` is this probe's own (its gradients are
    thrown away); it gets a zero .grad on every parameter first, as the executor's flat
    buffers give it, so backwards add into existing gradients as they do in a step. `group`:
    the process group the ranks time together on (None: the default one), False at world 1."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    C, V = model.config.n_embd, model.config.vocab_size
    gen = torch.Generator().manual_seed(rank)
    events = []
    for m in micros:
        idx = torch.randint(0, V, (m, seq_len), generator=gen).to(device)
        x = (torch.randn(m, seq_len, C, generator=gen) * 0.02).to(device, model.wpe.weight.dtype)
        for layer in COMPUTE_LAYERS:
            for rep in range(REPS + 1):  # the first warms up (allocations, kernel choice)
                inp = idx if layer == "embed" else x.detach().requires_grad_()
                if group is not False:
                    dist.barrier(group=group)
                _sync(device)
                t0 = time.perf_counter_ns()
                cast = torch.autocast(device.type, dtype=autocast) if autocast else None
                with cast or contextlib.nullcontext():
                    out = model.forward_layer(layer, inp, idx if layer == "head" else None)
                _sync(device)
                t1 = time.perf_counter_ns()
                if layer == "head":
                    torch.autograd.backward(out * model.loss_scale)
                else:
                    torch.autograd.backward(out, torch.ones_like(out))
                _sync(device)
                t2 = time.perf_counter_ns()
                if rep == 0:
                    continue
                for kind, a, b in (("fwd", t0, t1), ("bwd", t1, t2)):
                    args = {
                        "kind": kind,
                        "layer": layer,
                        "micro": m,
                        "tokens": m * seq_len,
                        "rep": rep - 1,
                    }
                    name = f"probe {kind}[{layer}] micro {m}"
                    events.append(probe_event(name, rank, tid, a / 1e3, (b - a) / 1e3, args))
    if group is not False:
        dist.barrier(group=group)
    return events
