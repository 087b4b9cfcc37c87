"""Recompute's memory/time trade-off on one CPU process: none, every other block, all blocks,
and none / all blocks with the head's loss chunked (`loss chunk --chunk` tokens).

    python bench/recompute.py                                  # gpt2, micro 16, 32 tokens
    python bench/recompute.py --model gpt2 --micro 16 --seq 32 --steps 3 --write docs/benchmarks.md

Each variant is the same world-1 schedule (`batch MICRO x SEQ`, one micro-step) with a
different `recompute` line, trained from the same seed in this process; all three are
alive at once and stepped in turn, each round in another order, so drift in a shared
machine favours none. Per variant: the median step time over the steps after the first
(the first creates AdamW's moments), and from the live heap (schedc/exec/heap.py, read
between ops and every millisecond): the activations saved at the end of forward (heap
right after fwd[head] minus the heap before the step's first op) and the peak of
activations during forward and backward (the step's heap peak before the optimizer step,
minus the same), each beside the ledger's prediction (schedc/passes/memory.py). The
optimizer's own temporaries (foreach AdamW: 4 bytes a parameter) are left out of both:
they are the same in every variant. A CPU is a slow stand-in for a GPU: ratios, not
seconds, are the result.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's schedc, whatever is installed

import torch  # noqa: E402

from schedc.compiler import compile_text  # noqa: E402
from schedc.exec.executor import Executor  # noqa: E402
from schedc.exec.heap import HeapPeak, heap_bytes  # noqa: E402
from schedc.exec.options import Comm, RunOptions
from schedc.ir.effects import Alloc, Free, Measure, Part, lifetimes  # noqa: E402
from schedc.ir.op import Kind  # noqa: E402

TEXT = """model {model}
world 1
batch {micro} x {seq}
micro {micro}
seed 1337
{recompute}
"""


def variants(n_layer: int, chunk: int) -> dict[str, str]:
    every = f"recompute h.0 .. h.{n_layer - 1}"
    return {
        "none": "",
        "every other block": "recompute " + ", ".join(f"h.{i}" for i in range(0, n_layer, 2)),
        "all blocks": every,
        f"none + loss chunk {chunk}": f"loss chunk {chunk}",
        f"all blocks + loss chunk {chunk}": f"{every}\nloss chunk {chunk}",
    }


def predicted(compiled) -> tuple[int, int]:
    """(activations live after the last forward, their peak), from the plan's lifetimes
    (ir/effects.py), the token batches left out."""
    plan = compiled.plan()
    life = lifetimes(compiled.spec, plan)
    sizes: dict[str, int] = {}
    live = after_fwd = peak = 0
    for ins, steps in zip(plan.instrs, life.steps):
        for s in steps:
            if isinstance(s, Alloc) and s.part is Part.ACTS:
                sizes[s.buffer] = s.nbytes
                live += s.nbytes
            elif isinstance(s, Free) and s.buffer in sizes:
                live -= sizes.pop(s.buffer)
            elif isinstance(s, Measure):
                peak = max(peak, live + s.acts)
        if ins.op is not None and ins.op.kind is Kind.FWD and ins.op.target == "head":
            after_fwd = live
    return after_fwd, peak


class Variant:
    """One schedule's executor, stepped on demand, with the heap read around its ops."""

    def __init__(self, text: str):
        self.compiled = compile_text(text)
        self.ex = Executor(
            self.compiled, Comm.from_env("gloo", 600), RunOptions(device="cpu", log=False)
        )
        self.marks: dict[str, int] = {}
        self.times: list[float] = []
        self.saved: list[int] = []
        self.peaks: list[int] = []
        compute = self.ex.backend.compute

        def watched(stream, op, fn):
            if op.kind is Kind.STEP:
                self.heap.sample()
                self.marks["fwd_bwd_peak"] = self.heap.peak
            compute(stream, op, fn)
            if op.kind is Kind.FWD and op.target == "head":
                self.marks["after_fwd"] = heap_bytes()

        self.ex.backend.compute = watched

    def step(self, timed: bool) -> None:
        with HeapPeak() as self.heap:
            t0 = time.perf_counter()
            self.ex.step()
            dt = time.perf_counter() - t0
        if timed:  # step 0 makes AdamW's moments
            self.times.append(dt)
            self.saved.append(self.marks["after_fwd"] - self.heap.start)
            self.peaks.append(self.marks["fwd_bwd_peak"] - self.heap.start)

    def result(self) -> dict:
        pred_saved, pred_peak = predicted(self.compiled)
        return {
            "ms": 1e3 * statistics.median(self.times),
            "iqr": [1e3 * q for q in statistics.quantiles(self.times, n=4)[::2]]
            if len(self.times) > 1
            else [1e3 * self.times[0]] * 2,
            "saved": max(self.saved),
            "peak": max(self.peaks),
            "pred_saved": pred_saved,
            "pred_peak": pred_peak,
        }


def measure(texts: dict[str, str], steps: int) -> dict[str, dict]:
    """Every variant alive at once, stepped in turn, each round in another order, so drift
    in a shared machine favours none."""
    runs = {name: Variant(text) for name, text in texts.items()}
    names = list(runs)
    for s in range(steps):
        order = names[s % len(names) :] + names[: s % len(names)]
        for name in order:
            runs[name].step(timed=s > 0)
    out = {name: runs[name].result() for name in names}
    for v in runs.values():
        v.ex.close()
    gc.collect()
    return out


def table(rows: dict[str, dict]) -> list[str]:
    base = rows["none"]
    out = [
        "| recompute | step ms (median) | IQR ms | vs none | saved at end of forward MiB "
        "(predicted) "
        "| x less | activation peak MiB (predicted) | x less |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['ms']:.0f} | {r['iqr'][0]:.0f}-{r['iqr'][1]:.0f} "
            f"| {r['ms'] / base['ms']:.2f}x "
            f"| {r['saved'] / 2**20:.1f} ({r['pred_saved'] / 2**20:.1f}) "
            f"| {base['saved'] / r['saved']:.2f}x "
            f"| {r['peak'] / 2**20:.1f} ({r['pred_peak'] / 2**20:.1f}) "
            f"| {base['peak'] / r['peak']:.2f}x |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant; the first untimed")
    ap.add_argument("--chunk", type=int, default=128, help="tokens per chunk of the loss")
    ap.add_argument("--write", help="append the table to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    n_layer = compile_text(
        TEXT.format(model=args.model, micro=args.micro, seq=args.seq, recompute="")
    ).spec.model.n_layer
    texts = {
        name: TEXT.format(model=args.model, micro=args.micro, seq=args.seq, recompute=line)
        for name, line in variants(n_layer, args.chunk).items()
    }
    rows = measure(texts, args.steps)
    for name, row in rows.items():
        print(name, row, flush=True)
    cmd = (
        f"python bench/recompute.py --model {args.model} --micro {args.micro} "
        f"--seq {args.seq} --steps {args.steps} --chunk {args.chunk}"
    )
    lines = [
        f"`{cmd}` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        *table(rows),
    ]
    print("\n".join(lines))
    if args.write:
        with open(args.write, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
