"""One benchmark case on this rank, under torchrun; prints one JSON line (rank 0).

    torchrun --standalone --nproc_per_node=2 bench/worker.py --case schedc-ddp \
        --schedule out/bench/ddp.sched --warmup 3 --steps 10

Cases: `loop` (the plain single-process training loop, schedc.model.reference), `schedc`
(any schedule, through schedc's executor), `torch-ddp` (DistributedDataParallel with its
default bucketing and no_sync for the first k-1 micro-steps), `torch-fsdp2` (fully_shard
per block, then the root). Every case trains the same model from the same seed on the
same global batch, and first proves it: step 0's gradients are compared with the
single-process reference on rank 0 (a benchmark that computes something else is void).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

from schedc.compiler import compile_file
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
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get(
        "LOCAL_WORLD_SIZE", "1"))))
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
        print(json.dumps({
            "case": args.case, "world": world, "times": times,
            "median_ms": 1e3 * statistics.median(times),
            "tokens_per_step": spec.tokens_per_step, "peak_rss_mb": [p[0] for p in peaks],
            "peak_heap_mb": [p[1] for p in peaks],
            "grad_max_abs_diff": check, "hidden_fraction": hidden,
            "threads": torch.get_num_threads(),
            "layout": getattr(case, "layout", None),
        }), flush=True)
    del case  # DDP's reducer must go before its process group does
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap + mmapped chunks):
    live memory, without the allocator's caching that RSS also counts."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


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


def check_grads(spec, grads: dict[str, torch.Tensor]) -> float:
    """Max |grad - reference grad| at step 0 (before clipping)."""
    batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
    ref = Reference(spec.model, spec.optim, batches, spec.micro, spec.steps, spec.seed)
    want = ref.step().grads
    return max((grads[n].float() - g).abs().max().item() for n, g in want.items())


# -- cases ----------------------------------------------------------------------------------------


class Loop:
    """The plain single-process loop: schedc.model.reference, the oracle itself."""

    def __init__(self, compiled, world, rank):
        s = compiled.spec
        batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.ref = Reference(s.model, s.optim, batches, s.micro, s.steps, s.seed)

    def step(self, record: bool):
        r = self.ref.step(record=record)
        return r.grads


class Schedc:
    def __init__(self, compiled, world, rank):
        from schedc.exec.executor import Comm, Executor, RunOptions

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

    def hidden_fraction(self, steps: int) -> float | None:
        """Share of collective time overlapped by compute, from a traced run's spans."""
        from schedc.exec.executor import Comm, Executor, RunOptions

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
    """torch's DistributedDataParallel: default buckets, no_sync for the first k-1."""

    def __init__(self, compiled, world, rank):
        from torch.nn.parallel import DistributedDataParallel as DDP

        s = self.spec = compiled.spec
        self.rank, self.world = rank, world
        self.model = init_model(s.model, s.seed)
        self.ddp = DDP(self.model)
        self.named = list(self.model.named_parameters())
        self.opt = make_adamw(self.named, s.optim)
        self.batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.index = 0
        self.buckets: list[list[str]] = []
        names = {id(p): n for n, p in self.named}

        self.comm_spans: list[list[float]] = []  # [launch, done] of each all-reduce

        def hook(state, bucket):  # record torch's bucket layout, then all-reduce as DDP does
            if len(self.buckets) <= bucket.index():
                self.buckets.append([names[id(p)] for p in bucket.parameters()])
            t = bucket.buffer().div_(world)
            span = [time.perf_counter(), 0.0]
            self.comm_spans.append(span)

            def done(f, span=span):
                span[1] = time.perf_counter()
                return f.value()[0]

            return dist.all_reduce(t, async_op=True).get_future().then(done)

        self.ddp.register_comm_hook(None, hook)

    def step(self, record: bool):
        s, k = self.spec, self.spec.accum
        self.opt.zero_grad(set_to_none=True)
        self.buckets = []  # what the hook sees this step (DDP rebuilds them after step 0)
        for j in range(k):
            x, y = self.batches.micro_batch(self.index, self.rank, j, s.micro, self.world)
            ctx = self.ddp.no_sync() if j < k - 1 else contextlib.nullcontext()
            with ctx:
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
    """torch's FSDP2: fully_shard per block, then the root (wte, wpe, ln_f)."""

    def __init__(self, compiled, world, rank):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        s = self.spec = compiled.spec
        self.rank, self.world = rank, world
        mesh = init_device_mesh("cpu", (world,))
        self.model = init_model(s.model, s.seed)
        for block in self.model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.named = list(self.model.named_parameters())
        self.opt = make_adamw(self.named, s.optim)
        self.batches = load_batches(s.data, s.seq_len, s.seqs, s.model.vocab_size)
        self.index = 0

    def step(self, record: bool):
        s, k = self.spec, self.spec.accum
        self.opt.zero_grad(set_to_none=True)
        for j in range(k):
            self.model.set_requires_gradient_sync(j == k - 1 or not s.no_sync)
            x, y = self.batches.micro_batch(self.index, self.rank, j, s.micro, self.world)
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
