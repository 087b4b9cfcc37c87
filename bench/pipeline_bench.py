"""schedc's pipeline executor against torch.distributed.pipelining, same split, same machine.

    PYTHONPATH=$PWD python bench/pipeline_bench.py                     # tiny, PP 4, m 8
    PYTHONPATH=$PWD python bench/pipeline_bench.py --model mini --m 8 --steps 4 --rounds 3

Four CPU ranks (gloo, one thread each, started here with torch.multiprocessing and a
FileStore) hold the same stages (exec/pipeline_model.py split_layers: embed .. head cut
evenly, each rank building only its own layers, initialised as the whole model). Per
schedule (gpipe, 1f1b) and round, each side runs `--steps` timed optimizer steps on the
same global batches after one untimed warm-up step:

- schedc: `PipelineExecutor.step()` on the programs of `pipeline_gen.generate`;
- torch: `ScheduleGPipe` / `Schedule1F1B` over a `PipelineStage` of the same RankModel
  (its last stage emits logits, cross-entropy is the schedule's loss_fn; torch scales the
  gradients by 1/m, schedc the loss), then the same update as schedc's: the tied wte's two
  copies all-reduced between the first and last rank, the global norm all-reduced, clipping,
  AdamW (model/reference.py make_adamw).

The step time of a round is the slowest rank's mean; the figure is the median over rounds,
and the ratio schedc / torch per schedule. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

PP = 4


def _torch_update(model, optimizer, opt, lr, ends, group) -> None:
    """schedc's update on torch's gradients: tied sum, global norm, clip, AdamW."""
    from schedc.model.reference import clip_coef

    named = list(model.named_parameters())
    wte = dict(named).get("wte.weight")
    if wte is not None and ends is not None:
        dist.all_reduce(wte.grad, group=ends)
    counted = [p.grad for n, p in named if not (n == "wte.weight" and model.holds_tied_copy)]
    sq = torch.stack(torch._foreach_norm(counted)).square().sum().double().reshape(1)
    dist.all_reduce(sq, group=group)
    grads = [p.grad for _, p in named]
    torch._foreach_mul_(grads, clip_coef(sq.sqrt().float()[0], opt.clip))
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    model.zero_grad(set_to_none=True)


class TorchStage(torch.nn.Module):
    """A RankModel's one stage as torch's PipelineStage wants it: one tensor in, one out
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


def _time(fn, steps: int, group) -> float:
    fn(0)  # warm-up
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        fn(s)
    mine = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine[0]) * 1e3


def _schedc(args, job_of, schedule, comm) -> float:
    from schedc.exec.pipeline import PipelineExecutor
    from schedc.passes.pipeline_gen import Request, generate

    gen = generate(Request(schedule, PP, args.m))
    job = job_of(args.steps + 1)
    ex = PipelineExecutor(job, gen, comm)
    return _time(lambda s: ex.step(), args.steps, comm.group)


def _torch(args, job_of, schedule, comm) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from schedc.exec.pipeline_model import RankModel
    from schedc.model.reference import make_adamw
    from schedc.passes.pipeline_gen import Schedule

    job, rank = job_of(args.steps + 1), comm.rank
    model = RankModel(job.model, job.split[rank], job.seed)
    stage = PipelineStage(TorchStage(model, job.split[rank]), rank, PP, torch.device("cpu"))
    kind = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B

    def loss_fn(logits, y):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    sched = kind(stage, args.m, loss_fn=loss_fn)
    optimizer = make_adamw(list(model.named_parameters()), job.optim)

    def step(s: int) -> None:
        x, y = job.batches.global_batch(s)
        if rank == 0:
            sched.step(x)
        elif rank == PP - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        _torch_update(model, optimizer, job.optim, job.optim.lr_at(s, args.steps + 1),
                      comm.tied, comm.group)  # fmt: skip

    return _time(step, args.steps, comm.group)


def _rank(rank: int, args, store_dir: str, out) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), PP)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PP)
    from schedc.exec.pipeline import PipeComm, PipeJob
    from schedc.exec.pipeline_model import split_layers
    from schedc.model.arch import SIZES
    from schedc.model.config import DataConfig, OptimConfig
    from schedc.model.data import load_batches
    from schedc.passes.pipeline_gen import Schedule

    cfg = SIZES[args.model]
    batches = load_batches(DataConfig(), args.seq, args.m * args.micro, cfg.vocab_size)
    split = split_layers(cfg, PP)

    def job_of(steps: int) -> PipeJob:
        return PipeJob(cfg, split, batches, OptimConfig(lr=1e-3, warmup=1), steps, seed=7)

    comm = PipeComm(rank, None, dist.new_group([0, PP - 1]))
    rows = []
    for r in range(args.rounds):
        for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
            for side, fn in (("schedc", _schedc), ("torch", _torch)):
                rows.append((r, schedule.value, side, fn(args, job_of, schedule, comm)))
    if rank == 0:
        out.put((split, rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--micro", type=int, default=2, help="sequences a micro-batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens a sequence")
    ap.add_argument("--steps", type=int, default=4, help="timed steps a round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, args, d, out)) for r in range(PP)]
        for p in procs:
            p.start()
        split, rows = out.get(timeout=1800)
        for p in procs:
            p.join()
    stages = [list(s) for s in split]
    print(f"{args.model}, PP {PP}, m {args.m} x {args.micro} seqs x {args.seq} tokens, "
          f"{args.rounds} rounds x {args.steps} timed steps; stages {stages}")  # fmt: skip
    print("| schedule | schedc step ms (median) | torch step ms (median) | schedc / torch |")
    print("|---|---|---|---|")
    for schedule in ("gpipe", "1f1b"):
        med = {
            side: statistics.median(t for _, s, sd, t in rows if s == schedule and sd == side)
            for side in ("schedc", "torch")
        }
        ratio = med["schedc"] / med["torch"]
        print(f"| {schedule} | {med['schedc']:.1f} | {med['torch']:.1f} | {ratio:.3f}x |")
    print("per round (ms):", [(r, s, sd, round(t, 1)) for r, s, sd, t in rows])


if __name__ == "__main__":
    main()
