"""How long the compiler takes, stage by stage, and how that grows with the ops of a step.

    python bench/compile.py [--repeat 3]

Times parse (text -> Lark tree -> AST), resolve, graph (build_graphs), check and lower for
schedules/gpt2_1gpu.sched and for generated GPT-2 XL (48-layer) schedules at 16, 32, 64
and 128 micro-steps, DDP and FSDP. Times are CPU time of this process (the machine may be
shared), each row the fastest of --repeat runs, with the cyclic GC paused as
compile_source pauses it; the last two columns are the same compile with the GC running.
The cost should be linear in the ops of a step: microseconds per op stay flat as the step
grows. A benchmark to read, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schedc.compiler import no_cyclic_gc  # noqa: E402
from schedc.lang.diagnostics import Diagnostics  # noqa: E402
from schedc.lang.parse import parse  # noqa: E402
from schedc.lang.read import source_from_text
from schedc.lang.resolve import resolve  # noqa: E402
from schedc.lang.syntax import to_ast  # noqa: E402
from schedc.passes.check import check_graphs, check_plans  # noqa: E402
from schedc.passes.graph import build_graphs  # noqa: E402
from schedc.passes.lower import lower  # noqa: E402
from schedc.passes.memory import predict  # noqa: E402

STAGES = ("parse", "resolve", "graph", "check", "lower")
MICRO_STEPS = (16, 32, 64, 128)
WORLD = 8


def xl_ddp(k: int) -> str:
    """GPT-2 XL on 8 ranks, k micro-steps of one sequence, 25 MiB buckets, no_sync."""
    return f"""model gpt2-xl
world {WORLD}
batch {WORLD * k} x 1024
micro 1
ddp {{
  bucket_cap 25 MiB
  overlap on
  no_sync on
}}
"""


def xl_fsdp(k: int) -> str:
    """GPT-2 XL on 8 ranks, k micro-steps, 12 units of 4 blocks, reduce-scatter every step."""
    units = ["  unit tied = wte.weight keep", "  unit u0 = wpe.weight, h.0 .. h.3"]
    units += [f"  unit u{i} = h.{4 * i} .. h.{4 * i + 3}" for i in range(1, 11)]
    units += ["  unit u11 = h.44 .. h.47, head"]
    return f"""model gpt2-xl
world {WORLD}
batch {WORLD * k} x 1024
micro 1
fsdp {{
{chr(10).join(units)}
  prefetch forward 1
  prefetch backward 1
  reshard_after_forward on
  no_sync off
}}
"""


def compile_timed(text: str, path: str, gc_on: bool = False) -> tuple[dict[str, float], int]:
    """CPU seconds per stage, and the number of ops in the plan.

    As compile_source does, the cyclic GC is paused unless `gc_on` (how it was before).
    """
    with contextlib.nullcontext() if gc_on else no_cyclic_gc():
        return _stages(text, path)


def _stages(text: str, path: str) -> tuple[dict[str, float], int]:
    t: dict[str, float] = {}
    t0 = time.process_time()
    source = source_from_text(text, path)
    ast = to_ast(parse(source), source)
    t1 = time.process_time()
    spec, _warnings = resolve(ast)
    t2 = time.process_time()
    graphs = build_graphs(spec)
    t3 = time.process_time()
    diag = Diagnostics(source)
    assert check_graphs(spec, graphs, diag)
    t4 = time.process_time()
    plans = {rank: lower(g) for rank, g in graphs.items()}
    t5 = time.process_time()
    memory = {rank: predict(spec, plan) for rank, plan in plans.items()}
    check_plans(spec, graphs, plans, memory, diag)
    diag.raise_if_any()
    t6 = time.process_time()
    t.update(parse=t1 - t0, resolve=t2 - t1, graph=t3 - t2, check=t4 - t3 + t6 - t5, lower=t5 - t4)
    return t, len(plans[None].ops)


def best_of(text: str, path: str, repeat: int, gc_on: bool = False) -> tuple[dict[str, float], int]:
    runs = [compile_timed(text, path, gc_on) for _ in range(repeat)]
    return min(runs, key=lambda r: sum(r[0].values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per schedule; the fastest counts")
    args = ap.parse_args(argv)

    cases = [("gpt2_1gpu.sched", (REPO / "schedules/gpt2_1gpu.sched").read_text(), 32)]
    cases += [(f"gpt2-xl ddp k={k}", xl_ddp(k), k) for k in MICRO_STEPS]
    cases += [(f"gpt2-xl fsdp k={k}", xl_fsdp(k), k) for k in MICRO_STEPS]

    compile_timed(cases[0][1], "warmup.sched")  # build the Lark parser once, outside the timing
    print(
        f"# schedc compile benchmark: python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, CPU time, best of {args.repeat}"
    )
    head = (
        f"| {'schedule':<20} | {'k':>4} | {'ops':>6} | "
        + " | ".join(f"{s + ' ms':>10}" for s in STAGES)
        + f" | {'total ms':>9} | {'us/op':>6} | {'GC on ms':>9} | {'us/op':>6} |"
    )
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for name, text, k in cases:
        t, ops = best_of(text, name, args.repeat)
        total = sum(t.values())
        gc_total = sum(best_of(text, name, args.repeat, gc_on=True)[0].values())
        print(
            f"| {name:<20} | {k:>4} | {ops:>6} | "
            + " | ".join(f"{t[s] * 1e3:>10.1f}" for s in STAGES)
            + f" | {total * 1e3:>9.1f} | "
            f"{total / ops * 1e6:>6.1f} | {gc_total * 1e3:>9.1f} | {gc_total / ops * 1e6:>6.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
