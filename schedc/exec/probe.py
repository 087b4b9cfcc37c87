"""Timed collectives of every kind, written into a trace beside the step's ops.

    schedc run FILE.sched --trace out.json --probe

A DDP schedule runs no all-gather and an FSDP one no all-reduce, yet one calibration trace
should price both (`schedc calibrate`, `schedc tune`): on gloo a byte of all-gather or
reduce-scatter costs about 4x a byte of all-reduce, so neither kind predicts the other.
Before step 0 each rank times all-reduce, all-gather and reduce-scatter on the world's
group at three sizes, twice each (nccl-tests' idea, fp32 buffers), between barriers; each
timing is one Chrome "X" event on a `probe` thread, named `probe KIND BYTES`, with args
kind, bytes (the full buffer: all-reduce's, all-gather's output, reduce-scatter's input),
ranks and rep. schedc/viz/trace.py `probes` reads them back; calibrate fits a kind the
schedule's own ops lack from them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes of the full buffer
KINDS = ("allreduce", "allgather", "reducescatter")
REPS = 2


def probe_collectives(group, rank: int, world: int, device: torch.device, tid: int) -> list[dict]:
    """The probe's trace events on this rank (every rank of `group` must call it)."""
    meta = {"ph": "M", "pid": rank, "tid": tid}
    events = [
        {"name": "thread_name", **meta, "args": {"name": "probe"}},
        {"name": "thread_sort_index", **meta, "args": {"sort_index": tid}},
    ]
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
                events.append(
                    {
                        "name": f"probe {kind} {numel * 4}",
                        "ph": "X",
                        "pid": rank,
                        "tid": tid,
                        "ts": t0 / 1e3,
                        "dur": (t1 - t0) / 1e3,
                        "cat": "probe",
                        "args": {"kind": kind, "bytes": numel * 4, "ranks": world, "rep": rep},
                    }
                )
    dist.barrier(group=group)
    return events


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
