"""`schedc calibrate`: fit the render cost model to a `schedc run --trace` file.

schedc calibrate t.json -o params.json      # then: schedc render ... --cost params.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedc.analysis.calibrate import calibrate
from schedc.analysis.cost import CostModel
from schedc.analysis.trace.stream import load
from schedc.cli.common import check_distinct, check_output, overrides
from schedc.compiler import compile_file
from schedc.errors import UserError

HELP = "fit the render cost model to a `schedc run --trace` file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="RUN.json", help="a trace from `schedc run --trace`")
    p.add_argument(
        "--schedule",
        metavar="FILE.sched",
        help="the schedule that was run (default: the one the trace names)",
    )
    p.add_argument("--model", help="model size the run used (if it passed --model)")
    p.add_argument(
        "--node-size",
        metavar="N",
        type=int,
        help="ranks per node the run had (torchrun --nproc_per_node): collectives whose "
        "group spans nodes fit the inter-node bandwidth (default 8)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="PARAMS.json",
        help="write the fitted parameters (for render --cost)",
    )


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_output("-o", args.output)
        check_distinct(
            ("-o", args.output), inputs=(("the trace", args.trace), ("--schedule", args.schedule))
        )
    trace = load(args.trace)  # validated: otherData.schedule is a file name if present
    path = args.schedule or trace.schedule
    if not path:
        raise UserError(f"{args.trace} does not name its schedule; pass --schedule FILE")
    if not args.schedule and not _exists(path):
        raise UserError(
            f"{args.trace} was recorded from {path}, which is not here; pass --schedule FILE"
        )
    c = compile_file(path, overrides(args))
    if args.node_size is not None and args.node_size < 1:
        raise UserError(f"--node-size must be >= 1, got {args.node_size}")
    base = CostModel(node_size=args.node_size) if args.node_size else CostModel()
    fit = calibrate(c, trace, base, name=args.trace)
    print(
        f"schedc: {args.trace} ({Path(path).name}, world {c.spec.world}): fitted by least squares"
    )
    print(fit.report())
    if args.output:
        try:
            Path(args.output).write_text(fit.cost.to_json())
        except OSError as e:
            raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
        print(f"schedc: wrote {args.output} (use: schedc render ... --cost {args.output})")
    return 0


def _exists(path: str) -> bool:
    """Whether the trace's schedule is here (a name too long for the file system is not)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False
