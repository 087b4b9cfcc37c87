"""`schedc tune` of a pipeline schedule: the search (tune/pipeline.py), its table and files.

schedc tune schedules/pipeline/tiny_pp2_dp2.sched --cost params.json -o best.sched
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from schedc.analysis.units import fmt_rate, fmt_time
from schedc.cli.common import write_candidates
from schedc.cli.render import default_cost_note
from schedc.errors import UserError
from schedc.ir.spec import Spec
from schedc.passes.memory import fmt_bytes
from schedc.tune.measure import error, measure, pick_vs_fastest
from schedc.tune.pipeline import PipeCandidate, PipeResult, own, search_pipeline
from schedc.tune.search import Options
from schedc.tune.space import Base


def tune_pipeline(args: argparse.Namespace, base: Base, opts: Options) -> int:
    if args.fit:
        raise UserError(
            f"--fit {args.fit}: the cost model is fitted to data-parallel traces; a pipeline "
            "run's trace times its items (`schedc render FILE --trace T --compare` draws it)"
        )
    res = search_pipeline(base, opts.cost, opts.budget_text, opts.precisions, opts.strategies)
    print(f"schedc: {args.file}: {res.counts()}")
    if not res.ranked:
        if res.first_refusal is not None:
            raise res.first_refusal  # the checker refused every one: say why, located
        raise UserError(f"{args.file}: no pipeline candidate (the world has no degree >= 2)")
    say_basis(args, res.ranked[0].spec, opts)
    print(table(res.ranked[: opts.top]))
    mine = own(base, opts.cost, opts.budget_text)
    if mine is not None:
        place = next((i + 1 for i, c in enumerate(res.ranked) if c.step >= mine.step), None)
        where = f"#{place} of {len(res.ranked)}" if place else "slower than every candidate"
        print(f"schedc: the file's own pipeline, predicted the same way ({where}):")
        print(table([mine], labels=["own"]))
    files = write(args, base, res, opts)
    if args.measure:
        measured(args, res.ranked[: args.measure], files, opts)
    return 0


def say_basis(args: argparse.Namespace, spec: Spec, opts: Options) -> None:
    """What a tune table was predicted for and with (both searches print it above theirs)."""
    print(
        f"schedc: model {spec.model_name}, world {spec.world}, batch {spec.seqs} x "
        f"{spec.seq_len}; predicted with {opts.cost.describe(spec.numerics)}"
        + (f"; budget {fmt_bytes(opts.budget)} per rank" if opts.budget else "")
    )
    if note := default_cost_note(args, args.file):
        print(note)


def table(
    cands: list[PipeCandidate],
    labels: list[str] | None = None,
    extra: list[list[str]] | None = None,
    head: tuple[str, ...] = (),
) -> str:
    """One row a candidate: its place (or label), the prediction (bubble: the idlest pipeline
    rank's share of the pipeline part; comm: the slowest rank's dp and tied collectives),
    the knobs, and `extra` columns under `head`."""
    rows = [["#", "step", "tokens/s", "peak", "comm", "bubble", "micro", "knobs", *head]]
    for i, c in enumerate(cands):
        rows.append(
            [
                labels[i] if labels else str(i + 1),
                fmt_time(c.step),
                fmt_rate(c.tokens_per_s, ""),
                fmt_bytes(c.peak),
                fmt_time(c.comm),
                f"{100 * max(c.bubble.values()):.1f}%",
                str(c.spec.micro),
                c.knobs.describe(),
                *(extra[i] if extra else []),
            ]
        )
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            x.ljust(w) if j == KNOBS else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    )


KNOBS = 7  # the knobs' column: left-aligned


def file_text(args, base: Base, c: PipeCandidate, rank: int, res: PipeResult, opts) -> str:
    cmd = f"schedc tune {args.file}" + (f" --budget {opts.budget_text}" if opts.budget else "")
    head = [
        f"# Written by `{cmd}`: #{rank}, fastest first, of the {len(res.ranked):,} simulated",
        f"# pipeline candidates ({res.considered:,} considered). Predicted with "
        f"{opts.cost.describe(c.spec.numerics)}:",
        f"#   step {fmt_time(c.step)}, {fmt_rate(c.tokens_per_s, 'tokens/s')}, dp and tied "
        f"collectives {fmt_time(c.comm)}, bubble up to {100 * max(c.bubble.values()):.1f}%,",
        f"#   peak {fmt_bytes(c.peak)} on the largest rank. Knobs: {c.knobs.describe()}",
    ]
    text = base.pipeline_text(
        c.knobs.block(), opts.budget_text, precision=c.knobs.precision is None, blank=False
    )
    if any(line.lstrip().startswith("#") for line in text.splitlines()):
        head.append("# The input's own comments follow: they describe the input, not these knobs.")
    return "\n".join([*head, ""]) + text


def write(args, base: Base, res: PipeResult, opts: Options) -> list[Path]:
    """The written files, best first (cli/common.py `write_candidates`)."""
    top = res.ranked[: opts.top]
    return write_candidates(
        args, [file_text(args, base, c, i + 1, res, opts) for i, c in enumerate(top)]
    )


def measured(args, cands: list[PipeCandidate], files: list[Path], opts: Options) -> None:
    """Run the best K under torchrun, and set what they took beside what was predicted."""
    _, timings = measure(cands, files[: len(cands)], args.steps, args.timeout, rounds=args.rounds)
    took = [t.step for t in timings]
    extra = [[fmt_time(m), f"{100 * error(c.step, m):+.1f}%"] for c, m in zip(cands, took)]
    rounds = f", the median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    print(
        "\npredicted vs measured (median step after the first, "
        f"{args.steps} steps each{rounds}), in predicted order:"
    )
    print(table(cands, extra=extra, head=("measured", "error")))
    errs = [abs(error(c.step, m)) for c, m in zip(cands, took)]
    print(f"\nmedian |error| {100 * statistics.median(errs):.1f}% over {len(cands)} measured")
    for line in pick_vs_fastest(timings):
        print(line)
    order = sorted(range(len(cands)), key=lambda i: took[i])
    print("re-ranked by measurement: " + ", ".join(f"#{i + 1}" for i in order))
    print(
        "note: pipeline runs are not refitted (their traces time items, not the cost "
        "model's terms); fit a cost model to a data-parallel run of this machine for --cost"
    )
