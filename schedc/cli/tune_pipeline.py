"""`schedc tune` of a pipeline schedule: the search (tune/pipeline.py), its table and files.

schedc tune schedules/pipeline/tiny_pp2_dp2.sched --cost params.json -o best.sched
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedc.analysis.units import fmt_rate, fmt_time
from schedc.cli.render import default_cost_note
from schedc.errors import UserError
from schedc.passes.memory import fmt_bytes
from schedc.tune.pipeline import PipeCandidate, PipeResult, own, search_pipeline
from schedc.tune.search import Options
from schedc.tune.space import Base


def tune_pipeline(args: argparse.Namespace, base: Base, opts: Options) -> int:
    if args.measure:
        raise UserError(
            f"--measure {args.measure}: tune measures data-parallel candidates only; run a "
            "written pipeline candidate with `schedc run` (--write-top DIR writes them)"
        )
    res = search_pipeline(base, opts.cost, opts.budget_text, opts.precisions, opts.strategies)
    print(f"schedc: {args.file}: {res.counts()}")
    if not res.ranked:
        if res.first_refusal is not None:
            raise res.first_refusal  # the checker refused every one: say why, located
        raise UserError(f"{args.file}: no pipeline candidate (the world has no degree >= 2)")
    spec = res.ranked[0].spec
    print(
        f"schedc: model {spec.model_name}, world {spec.world}, batch {spec.seqs} x "
        f"{spec.seq_len}; predicted with {opts.cost.describe(spec.numerics)}"
        + (f"; budget {fmt_bytes(opts.budget)} per rank" if opts.budget else "")
    )
    if note := default_cost_note(args, args.file):
        print(note)
    print(table(res.ranked[: opts.top]))
    mine = own(base, opts.cost, opts.budget_text)
    if mine is not None:
        place = next((i + 1 for i, c in enumerate(res.ranked) if c.step >= mine.step), None)
        where = f"#{place} of {len(res.ranked)}" if place else "slower than every candidate"
        print(f"schedc: the file's own pipeline, predicted the same way ({where}):")
        print(table([mine], labels=["own"]))
    write(args, base, res, opts)
    return 0


def table(cands: list[PipeCandidate], labels: list[str] | None = None) -> str:
    """One row a candidate: its place (or label), the prediction (bubble: the idlest pipeline
    rank's share of the pipeline part; comm: the slowest rank's dp and tied collectives)."""
    rows = [["#", "step", "tokens/s", "peak", "comm", "bubble", "micro", "knobs"]]
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
            ]
        )
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    last = len(widths) - 1
    return "\n".join(
        "  ".join(
            x.ljust(w) if j == last else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    )


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


def write(args, base: Base, res: PipeResult, opts: Options) -> None:
    """-o the best, --write-top the top N as DIR/1.sched, DIR/2.sched, ..."""
    top = res.ranked[: opts.top]
    texts = [file_text(args, base, c, i + 1, res, opts) for i, c in enumerate(top)]
    if args.output:
        Path(args.output).write_text(texts[0])
        print(f"schedc: wrote {args.output} (check it: schedc check {args.output})")
    if args.write_top:
        folder = Path(args.write_top)
        folder.mkdir(exist_ok=True)
        for i, t in enumerate(texts):
            (folder / f"{i + 1}.sched").write_text(t)
        shown = " ".join(str(folder / f"{i + 1}.sched") for i in range(min(3, len(texts))))
        print(
            f"schedc: wrote {len(texts)} files to {folder}/ (side by side: schedc render "
            f"{shown} -o top.svg)"
        )
