"""`schedc run`: train a schedule under torchrun (world 1: alone).

Only the flags live here; the executor (schedc/exec/) is imported when the verb runs, so
building the parser for any verb never imports torch.
"""

from __future__ import annotations

import argparse

from schedc.cli.common import add_override_args
from schedc.lang.diagnostics import UserError

HELP = "train: run a schedule under torchrun (world 1: alone)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="the schedule (default: the bundled "
                   "tiny_ddp_overlap.sched)")
    add_override_args(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds a rank waits for the others before failing (default 300)")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR")
    p.add_argument("--save-every", type=int, default=100, metavar="N",
                   help="checkpoint every N steps, and after the last (default 100)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default 2)")
    p.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    p.add_argument("--nonfinite", choices=["stop", "skip"], default="stop",
                   help="on a non-finite loss or gradient norm: stop the run (default), or "
                   "skip that update and say so")
    p.add_argument("--log-json", metavar="FILE", help="also append each step as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("`schedc run` trains with torch, which is not installed here; "
                        "scripts/install.sh installs it (check and render need no torch)") from None
    from schedc.exec.train import run_command

    return run_command(args)
