"""schedc's pipeline executor against torch.distributed.pipelining, same split, same machine.

    PYTHONPATH=$PWD python bench/pipeline_bench.py                     # PP 4 and PP 2 x DP 2
    PYTHONPATH=$PWD python bench/pipeline_bench.py --config pp4 --steps 6 --rounds 5
    PYTHONPATH=$PWD python bench/pipeline_bench.py --save out/run.json  # --replay out/run.json

Four CPU ranks (gloo, one thread each, started here with torch.multiprocessing and a
FileStore) hold the same stages (exec/pipeline_model.py split_layers: embed .. head cut
evenly, each rank building only its own layers, initialised as the whole model). The model
is `--model` (tiny) with `--layers` blocks (6: 8 layers, so PP 4 x v 2 has a layer a stage).
Two layouts of the 4 ranks: PP 4, and PP 2 x DP 2 (pp-outermost, exec/pipeline.py
make_comm). Per layout, schedule (gpipe, 1f1b, interleaved-1f1b with v = 2 stages a rank,
loop placement, zb-v with 2 a rank in a V) and round, each side runs `--steps` timed
optimizer steps on the same global batches after one untimed warm-up step, the side going
first alternating by round:

- schedc: `PipelineExecutor.step()` on the programs of `pipeline_gen.generate`, timed
  (`timed=True`: each item's start and end, analysis/pipeline_trace.py);
- torch: `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B` /
  `ScheduleZBVZeroBubble` over one
  `PipelineStage` per stage, each a RankModel of the stage's layers (the last stage emits
  logits, cross-entropy is the schedule's loss_fn; torch scales the gradients by 1/m,
  schedc the loss). With DP 2 each stage's gradients are averaged over its dp group after
  the schedule's step, one flat all-reduce a stage (schedc launches each stage's right
  after its last backward, overlapped with the rest of the program). Wrapping each stage
  module in DistributedDataParallel, which pipelining's stage drives itself (no_sync until
  the last backward), is how users compose the two, but on torch 2.13 + gloo it fails in
  the second step (`reducer.cpp` "rebuilt parameter indices size is not same as original
  model parameters size": 38 vs 76), so the bench does the reduction by hand. Then the
  same update as schedc's: the tied wte's two copies all-reduced between the first and
  last pipeline rank, the global norm, clipping, AdamW (model/reference.py make_adamw).

The step time of a round is the slowest rank's mean; the figure is the median over rounds,
and the ratio schedc / torch per schedule. The bubble: per timed schedc step, replica 0's
measured bubble per pipeline rank (idle share of the program's span, as the simulator
defines it), and passes/pipeline_sim.py's prediction at unit costs and at that step's
measured mean cost of each kind per stage; medians over steps. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from schedc.analysis.pipeline_trace import ItemSpan
from schedc.model.arch import SIZES

WORLD = 4
LAYOUTS = {"pp4": (4, 1), "pp2xdp2": (2, 2)}  # name -> (pp, dp)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")


def _v(schedule: str) -> int:
    return 2 if schedule in ("interleaved-1f1b", "zb-v") else 1


def _torch_update(models, optimizer, opt, lr, ends, group) -> None:
    """schedc's update on torch's gradients: tied sum, global norm, clip, AdamW."""
    from schedc.model.reference import clip_coef

    named = [(n, p) for m in models for n, p in m.named_parameters()]
    tied = any(m.holds_tied_copy for m in models)
    wte = [p for n, p in named if n == "wte.weight"]
    if len(wte) == 2:  # a V: both copies here, summed here
        wte[0].grad.add_(wte[1].grad)
        wte[1].grad.copy_(wte[0].grad)
    elif wte and ends is not None:
        dist.all_reduce(wte[0].grad, group=ends)
    counted = [p.grad for n, p in named if not (n == "wte.weight" and tied)]
    sq = torch.stack(torch._foreach_norm(counted)).square().sum().double().reshape(1)
    dist.all_reduce(sq, group=group)
    grads = [p.grad for _, p in named]
    torch._foreach_mul_(grads, clip_coef(sq.sqrt().float()[0], opt.clip))
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    for m in models:
        m.zero_grad(set_to_none=True)


class TorchStage(torch.nn.Module):
    """A RankModel of one stage as torch's PipelineStage wants it: one tensor in, one out
    (the last stage's output is the logits; the schedule's loss_fn makes the loss)."""

    def __init__(self, model, layers) -> None:
        super().__init__()
        self.model, self.layers = model, tuple(layers)

    def forward(self, x):
        body = [name for name in self.layers if name != "head"]
        x = self.model.run(body, x)
        if "head" in self.layers:
            x = F.linear(self.model.ln_f(x), self.model.wte.weight)  # (B, T, vocab)
        return x


def _time(fn, steps: int) -> float:
    fn(0)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        fn(s)
    mine = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0]) * 1e3


def _schedc(args, ctx, schedule) -> tuple[float, list]:
    from schedc.compiler import compile_text
    from schedc.exec.pipeline import PipelineExecutor
    from schedc.ir.pipeline import Schedule
    from schedc.passes.pipeline_bind import bind_rank

    job = ctx["job"](schedule)
    stages = "\n".join(f"  stage s{i} = {', '.join(layers)}" for i, layers in enumerate(job.split))
    text = (  # the same pipeline as a schedule file: compiled, proven and bound as `run` does
        f"model {args.model} {{ n_layer = {args.layers} }}\nworld {WORLD}\n"
        f"batch {job.batches.global_seqs} x {args.seq}\npipeline {{\n{stages}\n"
        f"  degree {ctx['pp']}\n  schedule {schedule}\n"
        f"  placement {Schedule(schedule).placement.value}\n  microbatches {args.m}\n}}\n"
    )
    c = compile_text(text, "<bench>")
    assert c.pipeline is not None
    bound = bind_rank(c.spec, c.pipeline.pipeline, c.pipeline.programs, dist.get_rank())
    ex = PipelineExecutor(job, c.pipeline.pipeline, ctx["comm"](schedule), bound, timed=True)
    ms = _time(lambda s: ex.step(), args.steps)
    assert ex.spans is not None
    return ms, [s for s in ex.spans if s.step > 0]


def _torch(args, ctx, schedule) -> tuple[float, list]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    from schedc.exec.pipeline_model import RankModel
    from schedc.ir.pipeline import Pipeline, Schedule
    from schedc.model.reference import make_adamw

    job, comm, pp, dp = ctx["job"](schedule), ctx["comm"](schedule), ctx["pp"], ctx["dp"]
    n = pp * _v(schedule)
    mine = Pipeline(pp, n, args.m, Schedule(schedule).placement).stages_of(comm.rank)
    models, stages = [], []
    for s in mine:
        model = RankModel(job.model, job.split[s], job.seed)
        module = TorchStage(model, job.split[s])
        models.append(model)
        stages.append(PipelineStage(module, s, n, torch.device("cpu"), group=comm.group))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    if schedule == "interleaved-1f1b":
        sched = ScheduleInterleaved1F1B(stages, args.m, loss_fn=loss_fn)
    elif schedule == "zb-v":
        sched = ScheduleZBVZeroBubble(stages, args.m, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = kind(stages[0], args.m, loss_fn=loss_fn)
    named = [(nm, p) for m in models for nm, p in m.named_parameters()]
    optimizer = make_adamw(named, job.optim, torch.optim.AdamW)
    micro = job.batches.global_seqs // (args.m * dp)

    def step(s: int) -> None:
        parts = [
            job.batches.micro_batch(s, comm.replica, j, micro, dp) for j in range(args.m)
        ]  # this replica's micro-batches, as schedc's replica reads them
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        ends = {"x": (x,)} if 0 in mine else {}
        if n - 1 in mine:
            ends |= {"target": y, "losses": []}
        sched.step(*ends.pop("x", ()), **ends)
        if dp > 1:  # each stage's gradients averaged over dp, one flat bucket a stage
            for m in models:
                grads = [p.grad for p in m.parameters()]
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=comm.dp)
                flat.div_(dp)
                for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(mean)
        lr = job.optim.lr_at(s, args.steps + 1)
        _torch_update(models, optimizer, job.optim, lr, comm.tied, comm.group)

    return _time(step, args.steps), []


def _rank(rank: int, args, store_dir: str, out) -> None:
    from schedc.exec.heap import keep_freed_memory

    torch.set_num_threads(1)
    if args.keep_heap:  # as `schedc run` does on a CPU; both sides share this process
        keep_freed_memory()
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    from schedc.exec.pipeline_comm import make_comm
    from schedc.exec.pipeline_model import PipeJob, split_layers
    from schedc.ir.pipeline import Pipeline, Placement, Schedule
    from schedc.model.config import DataConfig, OptimConfig
    from schedc.model.data import load_batches

    cfg = replace(SIZES[args.model], n_layer=args.layers)
    rows, spans = [], []
    for name in args.config:
        pp, dp = LAYOUTS[name]
        batches = load_batches(DataConfig(), args.seq, args.m * args.micro * dp, cfg.vocab_size)

        def job_of(schedule: str, pp=pp, batches=batches) -> PipeJob:
            split = split_layers(cfg, pp * _v(schedule))
            return PipeJob(cfg, split, batches, OptimConfig(lr=1e-3, warmup=1), args.steps + 1, 7)

        # a loop's tied pair is the first and last rank; a V's first and last stage are on
        # rank 0, which sums its two wte copies itself (every rank makes both, in one order)
        comms = {p: make_comm(rank, WORLD, Pipeline(pp, 2 * pp, args.m, p)) for p in Placement}
        ctx = {"pp": pp, "dp": dp, "job": job_of}
        ctx["comm"] = lambda sch, comms=comms: comms[Schedule(sch).placement]
        for r in range(args.rounds):
            for schedule in args.schedules:
                sides = [("schedc", _schedc), ("torch", _torch)]
                for side, fn in sides if r % 2 == 0 else sides[::-1]:
                    ms, mine = fn(args, ctx, schedule)
                    rows.append((name, r, schedule, side, ms))
                    spans += [(name, r, schedule, s) for s in mine]
    everything: list = [None] * WORLD
    dist.all_gather_object(everything, spans)
    if rank == 0:
        out.put((cfg, rows, [s for part in everything for s in part]))
    dist.destroy_process_group()


def _bubbles(args, spans) -> list[str]:
    """Per layout and schedule and pipeline rank: the measured bubble, the predicted one at
    each step's measured costs (`Measured.calibrated`) and at unit costs; medians over steps."""
    from schedc.analysis.pipeline_trace import measure
    from schedc.passes.pipeline_check import prove
    from schedc.passes.pipeline_gen import Request, Schedule, generate
    from schedc.passes.pipeline_sim import Costs, simulate

    lines = [
        "| layout | schedule | rank | measured bubble | predicted at measured costs | "
        "difference | predicted at unit costs |",
        "|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for name in args.config:
        pp, dp = LAYOUTS[name]
        for schedule in args.schedules:
            v = _v(schedule)
            gen = generate(Request(Schedule(schedule), pp, args.m, v))
            graph = prove(gen.pipeline, gen.programs).graph
            unit = simulate(graph, Costs(f=1 / v, b=2 / v, i=1 / v, w=1 / v)).bubble
            keys = sorted({(r, s.step) for n, r, sch, s in spans if n == name and sch == schedule})
            got: dict[int, list[tuple[float, float]]] = {r: [] for r in range(pp)}
            seen: list = []
            for rnd, step in keys:
                these = [s for n, r, sch, s in spans
                         if (n, sch, r, s.step) == (name, schedule, rnd, step)]  # fmt: skip
                m = measure(these, gen.programs, step, dp)
                seen.append(m.calibrated())
                pred = simulate(graph, seen[-1]).bubble
                for r in range(pp):
                    got[r].append((m.bubble[r], pred[r]))
            assert keys
            notes.append(
                f"{name} {schedule}: median over steps of the calibration: latency "
                f"{statistics.median(c.latency for c in seen):.2f} ms, posting "
                f"{statistics.median(c.post for c in seen):.3f} ms, between items "
                f"{statistics.median(c.gap for c in seen):.3f} ms"
            )
            for r in range(pp):
                meas = statistics.median(a for a, _ in got[r])
                pred = statistics.median(b for _, b in got[r])
                diff = f"{100 * (meas - pred):+.1f} pts ({(meas - pred) / pred:+.0%})"
                lines.append(f"| {name} | {schedule} | {r} | {100 * meas:.1f}% | "
                             f"{100 * pred:.1f}% | {diff} | {100 * unit[r]:.1f}% |")  # fmt: skip
    return lines + [""] + notes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks")
    ap.add_argument("--config", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--micro", type=int, default=2, help="sequences a micro-batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens a sequence")
    ap.add_argument("--steps", type=int, default=4, help="timed steps a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--keep-heap",
        action="store_true",
        help="both sides keep freed memory (glibc mallopt, exec/heap.py), as `schedc run` does "
        "on a CPU; default: glibc's defaults, what a torch pipelining script runs with",
    )
    ap.add_argument("--save", help="write the step times and every rank's item spans here")
    ap.add_argument("--replay", help="read a --save file and print its tables (runs nothing)")
    args = ap.parse_args(argv)
    if args.replay:
        with open(args.replay) as f:
            saved = json.load(f)
        args = argparse.Namespace(**(saved["args"] | {"replay": args.replay, "save": None}))
        cfg = replace(SIZES[args.model], n_layer=args.layers)
        rows = [tuple(r) for r in saved["rows"]]
        spans = [(n, r, sch, ItemSpan(**s)) for n, r, sch, s in saved["spans"]]
        print(f"replayed from {args.replay}")
    else:
        cfg, rows, spans = _run(args)
    heap = "; freed memory kept (--keep-heap)" if getattr(args, "keep_heap", False) else ""
    print(f"{args.model} with {cfg.n_layer} blocks, m {args.m} x {args.micro} seqs x {args.seq} "
          f"tokens a replica, {args.rounds} rounds x {args.steps} timed steps{heap}")  # fmt: skip
    print(
        "| layout | schedule | schedc step ms (median) | torch step ms (median) | schedc / torch |"
    )
    print("|---|---|---|---|---|")
    for name in args.config:
        for schedule in args.schedules:
            med = {
                side: statistics.median(
                    t for n, _, s, sd, t in rows if n == name and s == schedule and sd == side
                )
                for side in ("schedc", "torch")
            }
            ratio = med["schedc"] / med["torch"]
            print(f"| {name} | {schedule} | {med['schedc']:.1f} | {med['torch']:.1f} | "
                  f"{ratio:.3f}x |")  # fmt: skip
    if args.save:
        with open(args.save, "w") as f:
            saved = [(n, r, sch, asdict(s)) for n, r, sch, s in spans]
            json.dump({"args": vars(args), "rows": rows, "spans": saved}, f)
    print()
    print("\n".join(_bubbles(args, spans)))
    print()
    print("per round (ms):", [(n, r, s, sd, round(t, 1)) for n, r, s, sd, t in rows])


def _run(args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, args, d, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        cfg, rows, spans = out.get(timeout=3600)
        for p in procs:
            p.join()
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    return cfg, rows, spans


if __name__ == "__main__":
    main()
