"""`schedc tune`: search the legal schedules for the fastest one that fits, and write it.

    schedc tune schedules/gpt2_8gpu.sched --budget 80GiB -o best.sched
    schedc tune my.sched --cost params.json --measure 8 --fit fitted.json --write-top top/

The file fixes the model, world, global batch, data, optimizer, steps and seed; tune
searches the rest (schedc/tune/: the space, the bounds, the search; docs/tune.md). A
pipeline file's search is its degree, schedule, micro-batches and stage split
(tune/pipeline.py, cli/tune_pipeline.py).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from schedc.analysis.units import fmt_rate, fmt_time
from schedc.cli.common import (
    COUNT,
    POSITIVE,
    check_distinct,
    check_output,
    defaults,
    require,
    write_candidates,
)
from schedc.cli.render import add_cost_args, cost_from_args
from schedc.cli.tune_pipeline import say_basis, tune_pipeline
from schedc.errors import UserError
from schedc.ir.spec import POLICIES
from schedc.lang.resolve import UNITS, size_bytes
from schedc.passes.memory import fmt_bytes
from schedc.tune.measure import error, measure, pick_vs_fastest, refit, repredict
from schedc.tune.search import Candidate, Options, Result, fastest_absent, search
from schedc.tune.space import Base, fmt_size

HELP = "search the legal schedules of a file for the fastest that fits, and write it"
NOT_SEARCHED = (
    "tune searches flat DDP and FSDP layouts; the file's `{mesh}` (HSDP) is not in its "
    "space, and no written schedule has it"
)

# (flag, the flag it needs, what it does): alone, it would be silently ignored
NEEDS = [
    ("--steps", "--measure", "sets the steps of each measured run"),
    ("--rounds", "--measure", "repeats the measured runs"),
    ("--timeout", "--measure", "bounds each measured run"),
    ("--fit", "--measure", "writes the cost model fitted to the measured runs"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.sched", help="fixes model, world, batch, data, optimizer")
    p.add_argument(
        "--budget",
        metavar="SIZE",
        help="memory per rank for the predicted peak (activations included): 80GiB, 512 MiB "
        "(default: the file's `memory`, else none)",
    )
    p.add_argument("--top", type=POSITIVE, default=5, help="rows of the table (default 5)")
    p.add_argument(
        "--precision",
        metavar="LIST",
        help="numerics policies to search, comma-separated: fp32,bf16 (default: the file's)",
    )
    p.add_argument(
        "--strategy",
        metavar="LIST",
        default="ddp,fsdp",
        help="strategies to search at world > 1: ddp,fsdp (default both)",
    )
    p.add_argument("-o", "--output", metavar="BEST.sched", help="write the winner here")
    p.add_argument(
        "--write-top", metavar="DIR", help="write the top N as DIR/1.sched, DIR/2.sched, ..."
    )
    g = p.add_argument_group("measuring (runs the finalists under torchrun)")
    g.add_argument(
        "--measure", type=COUNT, default=0, metavar="K", help="run the best K (at most --top)"
    )
    g.add_argument("--steps", type=POSITIVE, help="steps per measured run (default 4)")
    g.add_argument(
        "--rounds",
        type=POSITIVE,
        help="run the K finalists this many times, interleaved, each measured as the median "
        "of its rounds (default 1; on a shared or throttling machine, 3)",
    )
    g.add_argument("--timeout", type=POSITIVE, help="seconds per measured run (default 600)")
    g.add_argument(
        "--fit", metavar="PARAMS.json", help="write the cost model fitted to the measured traces"
    )
    add_cost_args(p)


def parse_budget(text: str) -> tuple[int, str]:
    """A budget the way the language reads `memory` (lang/resolve/values.py `size_bytes`): a
    whole number of bytes below 1 EiB, so every candidate can say it."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2) not in UNITS:
        raise UserError(f"--budget {text!r}: expected a size such as 80GiB or 512 MiB")
    try:
        n = size_bytes(float(m.group(1)), m.group(2), "--budget", m.group(1))
    except ValueError as e:
        raise UserError(str(e)) from None
    return n, fmt_size(n)


def options(args, base: Base) -> Options:
    budget, budget_text = None, None
    if args.budget is not None:
        budget, budget_text = parse_budget(args.budget)
    elif base.memory:
        budget, budget_text = parse_budget(base.memory)
    precisions: tuple[str | None, ...] = (None,)
    if args.precision:
        names = [x.strip() for x in args.precision.split(",") if x.strip()]
        bad = [x for x in names if x not in POLICIES]
        if bad or not names:
            raise UserError(
                f"--precision {args.precision}: known policies are {', '.join(POLICIES)}"
            )
        precisions = tuple(dict.fromkeys(names))
    strategies = tuple(x.strip() for x in args.strategy.split(",") if x.strip())
    if not strategies or set(strategies) - {"ddp", "fsdp"}:
        raise UserError(f"--strategy {args.strategy}: expected ddp, fsdp or ddp,fsdp")
    return Options(budget, budget_text, cost_from_args(args), args.top, precisions, strategies)


def run(args: argparse.Namespace) -> int:
    check_output("-o", args.output)
    check_output("--fit", args.fit)
    check_output("--write-top", args.write_top, directory=True)
    check_distinct(
        ("-o", args.output),
        ("--fit", args.fit),
        ("--write-top", args.write_top),
        inputs=(("the schedule", args.file), ("--cost", args.cost)),
    )
    if args.measure > args.top:
        raise UserError(f"--measure {args.measure}: at most --top ({args.top})")
    require(args, NEEDS)
    defaults(args, steps=4, rounds=1, timeout=600)
    base = Base.read(args.file)
    if base.mesh:  # a pipeline file's too: its candidates shard over all dp replicas
        print(f"schedc: note: {args.file}: {NOT_SEARCHED.format(mesh=base.mesh)}")
    if base.pipeline:
        return tune_pipeline(args, base, options(args, base))
    opts = options(args, base)
    res = search(base, opts, progress=lambda line: print(f"schedc: tune: {line}", flush=True))
    print(f"schedc: {args.file}: {res.counts()}")
    if res.other_numerics:
        print(
            f"schedc: note: {' and '.join(sorted(res.other_numerics))} cannot compute what "
            f"{args.file} computes ({res.numerics}): tune keeps a file's numerics unless "
            "--precision asks it to search them"
        )
    if not res.ranked:
        if res.smallest_peak is None and res.first_refusal is not None:
            raise res.first_refusal  # the checker refused every one: say why, located
        raise UserError(nothing_fits(args.file, opts, res))
    say_basis(args, res.ranked[0].spec, opts)
    print(table(res.ranked))
    absent(base, opts, res)
    written = write(args, base, res, opts)
    if args.measure:
        measured(args, res.ranked[: args.measure], written, opts)
    return 0


def nothing_fits(path: str, opts: Options, res: Result) -> str:
    # without a budget every candidate the checker accepts ranks: nothing ranked is its refusal
    assert opts.budget is not None, "only a budget leaves nothing to rank"
    least = res.smallest_peak
    what = ""
    if least is not None:
        what = (
            f"; the smallest predicted peak is {fmt_bytes(least.peak)} "
            f"(activations {fmt_bytes(least.activations)} of it: "
            f"{least.knobs.describe()}, micro {least.knobs.micro})"
        )
    return f"{path}: no schedule fits the budget of {fmt_bytes(opts.budget)} per rank{what}"


def absent(base: Base, opts: Options, res: Result) -> None:
    """The fastest of each strategy the table has no row of, below it (tune/search.py)."""
    others = fastest_absent(base, opts, res)
    found = {s: c for s, c in others.items() if c is not None}
    for s in sorted(set(others) - set(found) - set(res.other_numerics)):  # those: said above
        print(f"schedc: no {s} schedule fits" + (" the budget" if opts.budget else ""))
    if found:
        first = fmt_time(res.ranked[0].step)
        print(f"schedc: the fastest of each strategy without a row above (#1 takes {first}):")
        print(table(list(found.values()), labels=list(found)))


def table(
    cands: list[Candidate],
    extra: list[list[str]] | None = None,
    head=(),
    labels: list[str] | None = None,
) -> str:
    """One row a candidate: `#` its place (or `labels`), then the prediction and the knobs."""
    rows = [["#", "step", "tokens/s", "peak", "comm", "exposed", "micro", "k", "knobs", *head]]
    for i, c in enumerate(cands):
        rows.append(
            [
                labels[i] if labels else str(i + 1),
                fmt_time(c.step),
                fmt_rate(c.tokens_per_s, ""),
                fmt_bytes(c.peak),
                fmt_time(c.comm),
                fmt_time(c.exposed),
                str(c.knobs.micro),
                str(c.spec.accum),
                c.knobs.describe(),
                *(extra[i] if extra else []),
            ]
        )
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            x.ljust(w) if j == 8 else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    )


def file_text(args, base: Base, c: Candidate, rank: int, res: Result, opts: Options) -> str:
    cmd = f"schedc tune {args.file}" + (f" --budget {opts.budget_text}" if opts.budget else "")
    head = [
        f"# Written by `{cmd}`: #{rank}, fastest first, of the {res.simulated:,} simulated",
        f"# ({res.considered:,} considered). Predicted with {opts.cost.describe(c.spec.numerics)}:",
        f"#   step {fmt_time(c.step)}, {fmt_rate(c.tokens_per_s, 'tokens/s')}, communication "
        f"{fmt_time(c.comm)} ({fmt_time(c.exposed)} exposed),",
        f"#   peak {fmt_bytes(c.peak)} per rank, activations {fmt_bytes(c.activations)} of it."
        " Knobs: " + c.knobs.describe(),
        *([f"# Not searched: {NOT_SEARCHED.format(mesh=base.mesh)}."] if base.mesh else []),
        *(
            [
                f"# Numerics: the input's, written out for {c.knobs.strategy} (its `precision` "
                f"statement would compute otherwise here): {c.spec.numerics.describe(c.spec.kind)}"
            ]
            if c.knobs.policy is not None
            else []
        ),
    ]
    text = base.text(c.knobs, c.spec.model, opts.budget_text, blank=False)
    if any(line.lstrip().startswith("#") for line in text.splitlines()):
        head.append("# The input's own comments follow: they describe the input, not these knobs.")
    return "\n".join([*head, ""]) + text


def write(args, base: Base, res: Result, opts: Options) -> list[Path]:
    """The written files, best first (cli/common.py `write_candidates`)."""
    texts = [file_text(args, base, c, i + 1, res, opts) for i, c in enumerate(res.ranked)]
    return write_candidates(args, texts, " --view timeline")


def measured(args, cands: list[Candidate], files: list[Path], opts: Options) -> None:
    runs, timings = measure(
        cands, files[: len(cands)], args.steps, args.timeout, rounds=args.rounds
    )
    fitted, notes = refit(runs, opts.cost)
    again = repredict(cands, fitted)
    took = [t.step for t in timings]
    extra = [
        [
            fmt_time(m),
            f"{100 * error(c.step, m):+.1f}%",
            fmt_time(p),
            f"{100 * error(p, m):+.1f}%",
        ]
        for c, m, p in zip(cands, took, again)
    ]
    rounds = f", the median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    print(
        "\npredicted vs measured (median step after the first, "
        f"{args.steps} steps each{rounds}), in predicted order:"
    )
    print(table(cands, extra, ("measured", "error", "refit", "error")))
    errs = [abs(error(c.step, m)) for c, m in zip(cands, took)]
    refit_errs = [abs(error(p, m)) for p, m in zip(again, took)]
    print(
        f"\nmedian |error| {100 * statistics.median(errs):.1f}% over {len(cands)} measured "
        f"({100 * statistics.median(refit_errs):.1f}% with the cost model refitted to their "
        "traces)"
    )
    for line in pick_vs_fastest(timings):
        print(line)
    order = sorted(range(len(cands)), key=lambda i: took[i])
    print("re-ranked by measurement: " + ", ".join(f"#{i + 1}" for i in order))
    for n in notes:
        print(f"note: {n}")
    print("refitted: " + fitted.describe(cands[0].spec.numerics))
    if args.fit:
        Path(args.fit).write_text(fitted.to_json())
        print(f"schedc: wrote {args.fit} (use: schedc tune ... --cost {args.fit})")
