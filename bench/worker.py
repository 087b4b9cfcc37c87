"""One benchmark case on this rank, under torchrun; prints one JSON line (rank 0).

    torchrun --standalone --nproc_per_node=2 bench/worker.py --case schedc-ddp \
        --schedule out/bench/ddp.sched --warmup 3 --steps 10

Cases: `loop` (the plain single-process training loop, schedc.model.reference), `schedc`
(any schedule, through schedc's executor), `torch-ddp` (DistributedDataParallel with its
default bucketing and no_sync for the first k-1 micro-steps), `torch-fsdp2` (fully_shard
per block, then the root). Every case trains the same model from the same seed on the
same global batch, and first proves it: step 0's gradients are compared with the
single-process reference on rank 0 (a benchmark that computes something else is void).

The schedule's `precision` is the policy of every case, torch's included: compute bf16 is
bf16 autocast of each forward (torch.autocast, as the reference and schedc's executor do);
DDP's reduce bf16 is torch's `bf16_compress_hook`; FSDP2 gets
`MixedPrecisionPolicy(param_dtype=<gather>, reduce_dtype=<reduce>)`. The reference runs
the same policy (compute dtype, and for FSDP the gather dtype as its parameter dtype).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

from schedc.compiler import compile_file
from schedc.exec.heap import heap_bytes as _heap_bytes
from schedc.exec.heap import keep_freed_memory
from schedc.model.data import load_batches
from schedc.model.reference import Reference, clip_coef, global_grad_norm, init_model, make_adamw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--schedule", required=True, help="the schedule that defines the run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trace-steps", type=int, default=2, help="extra traced steps (schedc)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    keep_freed_memory()  # what `schedc run` does on a CPU; every case alike, baselines too
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    compiled = compile_file(args.schedule)
    spec = compiled.spec
    steps = args.warmup + args.steps

    base_rss, base_heap = rss_bytes(), heap_bytes()  # before the model exists
    case = CASES[args.case](compiled, world, rank)
    grads0 = case.step(record=True)
    check = check_grads(spec, grads0) if rank == 0 else None
    times = []
    with RSSPeak() as peak:
        for i in range(1, steps):
            t0 = time.perf_counter()
            case.step(record=False)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    hidden = case.hidden_fraction(args.trace_steps) if hasattr(case, "hidden_fraction") else None
    mine = ((peak.bytes - base_rss) / 2**20, (peak.heap - base_heap) / 2**20)
    peaks = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(peaks, mine)
    else:
        peaks = [mine]
    if rank == 0:
        print(
            json.dumps(
                {
                    "case": args.case,
                    "world": world,
                    "times": times,
                    "median_ms": 1e3 * statistics.median(times),
                    "tokens_per_step": spec.tokens_per_step,
                    "peak_rss_mb": [p[0] for p in peaks],
                    "peak_heap_mb": [p[1] for p in peaks],
                    "grad_max_abs_diff": check["max_abs"],
                    "grad_check": check,
                    "hidden_fraction": hidden,
                    "memory": getattr(case, "memory", None),
                    "threads": torch.get_num_threads(),
                    "layout": getattr(case, "layout", None),
                }
            ),
            flush=True,
        )
    del case  # DDP's reducer must go before its process group does
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def heap_bytes() -> int:
    """Live heap (schedc.exec.heap: glibc's in-use bytes, without the allocator's cache)."""
    return _heap_bytes() or 0


class RSSPeak:
    """The highest resident set size seen while the block runs (sampled every ms).

    ru_maxrss cannot serve: it is a lifetime high-water mark, and model initialisation
    (full weights on every rank, before sharding) would hide the training step's peak.
    """

    def __enter__(self):
        self.bytes = rss_bytes()
        self.heap = heap_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.bytes = max(self.bytes, rss_bytes())
            self.heap = max(self.heap, heap_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, rss_bytes())
        return False


def dtype(d) -> torch.dtype | None:
    """A policy Dtype as torch's, None for fp32 (nothing to cast or autocast)."""
    return None if d.value == "fp32" else getattr(torch, {"bf16": "bfloat16"}[d.value])


def autocast(spec):
    """The forward's context under the schedule's compute dtype."""
    low = dtype(spec.numerics.compute)
    return torch.autocast("cpu", dtype=low) if low else contextlib.nullcontext()


def low_precision(spec) -> bool:
    return any(getattr(spec.numerics, f).value != "fp32" for f in ("compute", "gather", "reduce"))


# tests/oracle.py's "bf16" tolerance at the first step (derived and measured there: a bf16
# reduction or gather rounds each element to 2^-8 of a rank's share): every element within
# 1e-2 + 2e-2 |ref|, 99% of them within 3e-4 + 2e-2 |ref|.
BF16_RTOL, BF16_ATOL, BF16_BULK_ATOL, BF16_SHARE = 2e-2, 1e-2, 3e-4, 0.99


def reference_grads(spec, policy: bool) -> dict[str, torch.Tensor]:
    batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
    n, fsdp = spec.numerics, spec.kind.value == "fsdp"
    kw = (
        dict(compute=dtype(n.compute), param_dtype=dtype(n.gather) if fsdp else None)
        if policy
        else {}
    )
    ref = Reference(spec.model, spec.optim, batches, spec.micro, spec.steps, spec.seed, **kw)
    return ref.step().grads


def check_grads(spec, grads: dict[str, torch.Tensor]) -> dict:
    """Step 0's gradients (before clipping) against the single-process reference under the
    same policy: the max |grad - ref|, and under a bf16 policy whether they are within the
    bf16 tolerance above and nearer (in L2) to that reference than to the fp32 one, which
    tells a case that really rounds to bf16 from one that silently computes in fp32."""
    want = reference_grads(spec, policy=True)
    out = {
        "max_abs": max((grads[n].float() - g).abs().max().item() for n, g in want.items()),
        "ok": True,
    }
    if not low_precision(spec):
        return out

    def l2(ref):
        return sum(float((grads[n].float() - g).pow(2).sum()) for n, g in ref.items()) ** 0.5

    worst, close, total = 0.0, 0, 0
    for n, g in want.items():
        err = (grads[n].float() - g).abs() - BF16_RTOL * g.abs()
        worst = max(worst, err.max().item())
        close += int((err <= BF16_BULK_ATOL).sum())
        total += g.numel()
    out.update(
        beyond_rtol=worst,
        share_bulk=close / total,
        l2_policy=l2(want),
        l2_fp32=l2(reference_grads(spec, policy=False)),
    )
    out["ok"] = (
        worst <= BF16_ATOL and close >= BF16_SHARE * total and out["l2_policy"] < out["l2_fp32"]
    )
    return out


# -- cases ----------------------------------------------------------------------------------------


class Loop:
    """The plain single-process loop: schedc.model.reference, the oracle itself."""

    def __init__(self, compiled, world, rank):
        s = compiled.spec
        batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.ref = Reference(
            s.model, s.optim, batches, s.micro, s.steps, s.seed, compute=dtype(s.numerics.compute)
        )

    def step(self, record: bool):
        r = self.ref.step(record=record)
        return r.grads


class Schedc:
    def __init__(self, compiled, world, rank):
        from schedc.exec.executor import Executor
        from schedc.exec.options import Comm, RunOptions

        self.compiled, self.world, self.rank = compiled, world, rank
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.comm = Comm(rank, world)
        self.ex = Executor(compiled, self.comm, RunOptions(device="cpu", log=False))
        self.first = True

    def step(self, record: bool):
        self.ex.opts.record = record
        st = self.ex.step()
        return st.grads

    @property
    def memory(self) -> dict[str, list[int]]:
        """Per-rank [predicted, measured] bytes, as `schedc run` reports them (this rank)."""
        pred, meas = self.compiled.memory, self.ex.memory()
        return {
            "states": [pred.states, meas["states"]],
            "gathered_peak": [pred.gathered_peak, meas["gathered_peak"]],
            "grads_peak": [pred.grads_peak, meas["grads_peak"]],
        }

    def hidden_fraction(self, steps: int) -> float | None:
        """Share of collective time overlapped by compute, from a traced run's spans."""
        from schedc.exec.executor import Executor
        from schedc.exec.options import Comm, RunOptions

        if not self.compiled.spec.strategy or steps <= 0:
            return None
        comm = Comm(self.rank, self.world, tag="traced")
        ex = Executor(self.compiled, comm, RunOptions(device="cpu", log=False, trace=True))
        for _ in range(steps):
            ex.step()
        ex.close()
        return hidden_share(ex.trace_events(), self.rank)


def hidden_share(events: list[dict], rank: int) -> float | None:
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["cat"] == "compute")
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["cat"] == "collective"]
    total = sum(b - a for a, b in comm)
    if total <= 0:
        return None
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return hidden / total


class TorchDDP:
    """torch's DistributedDataParallel: default buckets, no_sync for the first k-1; under
    compute bf16 each forward in bf16 autocast, under reduce bf16 its bf16_compress_hook."""

    def __init__(self, compiled, world, rank):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            bf16_compress_hook,
        )
        from torch.nn.parallel import DistributedDataParallel as DDP

        s = self.spec = compiled.spec
        self.rank, self.world = rank, world
        self.model = init_model(s.model, s.seed)
        self.ddp = DDP(self.model)
        self.named = list(self.model.named_parameters())
        self.opt = make_adamw(self.named, s.optim, torch.optim.AdamW)
        self.batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.index = 0
        self.buckets: list[list[str]] = []
        names = {id(p): n for n, p in self.named}

        self.comm_spans: list[list[float]] = []  # [launch, done] of each all-reduce

        def hook(state, bucket):  # record torch's bucket layout, then all-reduce as DDP does
            if len(self.buckets) <= bucket.index():
                self.buckets.append([names[id(p)] for p in bucket.parameters()])
            span = [time.perf_counter(), 0.0]
            self.comm_spans.append(span)

            def done(f, span=span):
                span[1] = time.perf_counter()
                v = f.value()
                return v[0] if isinstance(v, list) else v

            if compress:  # torch's own hook: cast to bf16, divide, all-reduce, cast back
                return bf16_compress_hook(None, bucket).then(done)
            t = bucket.buffer().div_(world)
            return dist.all_reduce(t, async_op=True).get_future().then(done)

        compress = dtype(s.numerics.reduce) is not None

        self.ddp.register_comm_hook(None, hook)

    def step(self, record: bool):
        s, k = self.spec, self.spec.accum
        self.opt.zero_grad(set_to_none=True)
        self.buckets = []  # what the hook sees this step (DDP rebuilds them after step 0)
        for j in range(k):
            x, y = self.batches.micro_batch(self.index, self.rank, j, s.micro, self.world)
            ctx = self.ddp.no_sync() if j < k - 1 else contextlib.nullcontext()
            with ctx:
                with autocast(s):
                    _, loss = self.ddp(x, y)
                self.backward_start = time.perf_counter()
                (loss / k).backward()
        grads = [p.grad for _, p in self.named]
        norm = global_grad_norm(grads)
        out = {n: p.grad.clone() for n, p in self.named} if record else {}
        for g in grads:
            g.mul_(clip_coef(norm, s.optim.clip))
        for g in self.opt.param_groups:
            g["lr"] = s.optim.lr_at(self.index, s.steps)
        self.opt.step()
        self.index += 1
        return out

    def hidden_fraction(self, steps: int) -> float | None:
        """Share of all-reduce time overlapped by backward compute (from the hook's times).

        Backward computes on the main thread from its start until the last bucket is
        launched (its gradients are the last ones computed); an all-reduce is hidden while
        it runs inside that window. An approximation, stated as such in the results.
        """
        hidden = total = 0.0
        for _ in range(steps):
            self.comm_spans = []
            self.step(record=False)
            end = max(a for a, _ in self.comm_spans)
            for a, b in self.comm_spans:
                total += b - a
                hidden += max(0.0, min(b, end) - max(a, self.backward_start))
        return hidden / total if total else None

    @property
    def layout(self) -> list[list[str]]:
        """torch's buckets in launch order, by parameter name (as of the last step)."""
        return self.buckets


class TorchFSDP2:
    """torch's FSDP2: fully_shard per block, then the root (wte, wpe, ln_f); the schedule's
    gather and reduce dtypes as its MixedPrecisionPolicy, its compute dtype as autocast (as
    schedc's `compute` is; FSDP2 alone would also run layer norms and the loss in bf16)."""

    def __init__(self, compiled, world, rank):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        s = self.spec = compiled.spec
        self.rank, self.world = rank, world
        if s.hsdp:  # FSDP2's HSDP: shard over the last dimension, replicate over the first
            m = s.mesh
            mesh = init_device_mesh(
                "cpu", (m.replicate, m.shard), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh("cpu", (world,))
        self.model = init_model(s.model, s.seed)
        mp = MixedPrecisionPolicy(
            param_dtype=dtype(s.numerics.gather),
            reduce_dtype=dtype(s.numerics.reduce) or torch.float32,
        )
        for block in self.model.h:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        self.named = list(self.model.named_parameters())
        self.opt = make_adamw(self.named, s.optim, torch.optim.AdamW)
        self.batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.index = 0

    def step(self, record: bool):
        s, k = self.spec, self.spec.accum
        self.opt.zero_grad(set_to_none=True)
        for j in range(k):
            self.model.set_requires_gradient_sync(j == k - 1 or not s.no_sync)
            x, y = self.batches.micro_batch(self.index, self.rank, j, s.micro, self.world)
            with autocast(s):
                _, loss = self.model(x, y)
            (loss / k).backward()
        grads = [p.grad for _, p in self.named]
        norm = torch.nn.utils.get_total_norm(grads)
        out = {n: p.grad.full_tensor().clone() for n, p in self.named} if record else {}
        torch.nn.utils.clip_grads_with_norm_([p for _, p in self.named], s.optim.clip, norm)
        for g in self.opt.param_groups:
            g["lr"] = s.optim.lr_at(self.index, s.steps)
        self.opt.step()
        self.index += 1
        return out


CASES = {"loop": Loop, "schedc": Schedc, "torch-ddp": TorchDDP, "torch-fsdp2": TorchFSDP2}

if __name__ == "__main__":
    main()
