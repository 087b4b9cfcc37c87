"""The CLI verbs. Each is (add_arguments, run, help); each compiles through compiler.py."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from schedc.check import fmt_bytes
from schedc.compiler import Compiled, compile_file
from schedc.errors import CompileError, render_all
from schedc.resolve import DDPSpec, FSDPSpec, Overrides, describe_params
from schedc.resources import bundled_schedules


class UserError(Exception):
    """A mistake in how schedc was called (not in a schedule): printed, exit 1."""


def overrides(args) -> Overrides:
    """The flags that override the file, judged by the file's rules before anything compiles
    (so a bad one is said once, not once per schedule): a CompileError, exit 1."""
    ov = Overrides(model=getattr(args, "model", None), steps=getattr(args, "steps", None),
                   seed=getattr(args, "seed", None))
    if diags := ov.diagnostics():
        raise CompileError(diags)
    return ov


def _number(kind, lo, hi=None, *, what: str):
    """An argparse `type=` for a number in [lo, hi] (finite): anything else is a usage error."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not (math.isfinite(v) and v >= lo and (hi is None or v <= hi)):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return v

    parse.__name__ = what  # argparse names the type in "invalid <name> value"
    return parse


# --timeout: > 0 and finite (gloo and NCCL take whole milliseconds, datetime.timedelta
# overflows near 1e14 s); a million seconds is eleven days of waiting.
TIMEOUT_S = _number(float, 0.001, 1e6, what="number of seconds")
POSITIVE = _number(int, 1, what="whole number >= 1")
COUNT = _number(int, 0, what="whole number >= 0")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model size (overrides the file)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides the file)")
    p.add_argument("--seed", type=int, help="seed (overrides the file)")


# -- check ----------------------------------------------------------------------------------------


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="one schedule, or two to prove they agree (default: every bundled "
                   "schedule)")
    p.add_argument("--dump", choices=["ast", "graph", "program", "plan"],
                   help="print a stage's text form instead of the summary")
    p.add_argument("--rank", type=int, help="the rank whose graph/program/plan to dump")
    _add_overrides(p)


def _check(args) -> int:
    from schedc.dump import DUMPS

    files = [Path(f) for f in args.files] or bundled_schedules()
    if args.dump and len(files) != 1 and args.files:
        raise UserError("--dump takes one file")
    ov = overrides(args)  # a bad flag is one error, not one per file
    errors: list[CompileError] = []
    compiled: list[Compiled] = []
    for f in files:
        try:
            c = compile_file(f, ov)
        except CompileError as e:
            errors.append(e)
            continue
        compiled.append(c)
        if args.rank is not None and not 0 <= args.rank < c.spec.world:
            from schedc.errors import Diagnostic
            from schedc.resolve import flag_place, range_error

            raise CompileError([Diagnostic(
                "value-range", range_error("rank", args.rank, 0, c.spec.world - 1),
                path=flag_place("rank", args.rank),
                hint=f"{c.source.path} is a world-{c.spec.world} schedule: ranks 0 .. "
                f"{c.spec.world - 1}")])
        if c.warnings:  # bounded like errors: the first MAX_SHOWN, then a count
            print(render_all(list(c.warnings), c.source), file=sys.stderr)
        if args.dump:
            text = DUMPS[args.dump](c, args.rank) if args.dump != "ast" else DUMPS["ast"](c)
            print(text if len(files) == 1 else f"## {f}\n{text}")
        else:
            print(summary(c))
    if len(args.files) == 2 and len(compiled) == 2 and not args.dump:
        from schedc.agree import compare

        a, b = compiled
        result = compare(a.spec, b.spec)
        ta, tb = result.tokens
        print(f"\n{a.source.path}: {ta:,} tokens per update")
        print(f"{b.source.path}: {tb:,} tokens per update")
        if not result.agree:
            raise CompileError(result.diagnostics, b.source)
        w = a.spec.loss_weight()
        print(f"agree: same model, same {a.spec.seqs:,} sequences each read once, every token "
              f"weighted {w.numerator}/{w.denominator} in the loss (1/k x 1/D x micro mean), "
              "same optimizer: the same update")
    if errors:
        for e in errors[:-1]:
            print(e.render(), file=sys.stderr)
        raise errors[-1]
    return 0


def summary(c: Compiled) -> str:
    s, cfg = c.spec, c.spec.model
    plan = c.plan()
    n_ops = {st: 0 for st in plan.streams}
    for ins in plan.instrs:
        if ins.kind == "run":
            n_ops[ins.stream] += 1
    k = s.accum
    lines = [
        f"{c.source.path}: ok",
        f"  model     {s.model_name}: {cfg.numel:,} params ({cfg.n_layer} layers, "
        f"{cfg.n_head} heads, C={cfg.n_embd}, context {cfg.block_size}, vocab {cfg.vocab_size})",
        f"  batch     {s.seqs:,} x {s.seq_len:,} = {s.tokens_per_step:,} tokens per update",
        f"  split     world {s.world} x micro {s.micro} x {k} micro-step{'s' if k != 1 else ''}"
        + (" (no_sync: only the last communicates)" if s.no_sync and k > 1 else ""),
    ]
    st = s.strategy
    if isinstance(st, DDPSpec):
        how = f"bucket_cap {fmt_bytes(st.cap)}" if st.cap else "explicit buckets"
        lines.append(f"  strategy  DDP, {len(st.buckets)} buckets ({how}), overlap "
                     f"{'on' if st.overlap else 'off'}")
        for b in st.buckets:
            lines.append(f"    {b.name:<6} {fmt_bytes(b.nbytes):>11}  "
                         f"{describe_params(cfg, b.params)}")
    elif isinstance(st, FSDPSpec):
        lines.append(f"  strategy  FSDP, {len(st.units)} units, prefetch forward "
                     f"{st.prefetch_forward} backward {st.prefetch_backward}, reshard_after_forward "
                     f"{'on' if st.reshard_after_forward else 'off'}")
        for u in st.units:
            keep = "  (kept gathered)" if u.keep else ""
            lines.append(f"    {u.name:<6} {fmt_bytes(u.nbytes):>11}  "
                         f"{describe_params(cfg, u.params)}{keep}")
    else:
        lines.append("  strategy  one process: gradients added across micro-steps")
    comm = ", ".join(f"{stn} {n}" for stn, n in n_ops.items())
    lines.append(f"  streams   {comm} ops; {len(plan.producers)} events")
    m = c.memory
    mem = ", ".join(f"{name} {fmt_bytes(v)}" for name, v in m.rows() if v)
    budget = f" (budget {fmt_bytes(s.memory)})" if s.memory else ""
    lines.append(f"  memory    per rank{budget}: {mem}")
    return "\n".join(lines)


COMMANDS = {
    "check": (_check_args, _check, "prove schedules legal; print a summary or a stage's text"),
}


# -- run (imports torch only when used) ----------------------------------------------------------


def _run_args(p: argparse.ArgumentParser) -> None:
    # written here, not imported from schedc.run: every verb builds this parser, and
    # `schedc check` must not import torch (it runs on machines without it)
    p.add_argument("file", nargs="?", help="the schedule (default: the bundled "
                   "tiny_ddp_overlap.sched)")
    _add_overrides(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--timeout", type=TIMEOUT_S, default=300.0, metavar="S",
                   help="seconds a rank waits for the others before failing (default 300)")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR")
    p.add_argument("--save-every", type=POSITIVE, default=100, metavar="N",
                   help="checkpoint every N steps, and after the last (default 100)")
    p.add_argument("--keep", type=COUNT, default=2,
                   help="checkpoints to keep (default 2; 0 keeps every one)")
    p.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    p.add_argument("--checkpoint-key", metavar="FILE", help="a secret (16-4096 bytes): --save "
                   "signs meta.json with its HMAC-SHA256, --resume refuses a checkpoint whose "
                   "HMAC is missing or wrong (README, Robustness)")
    p.add_argument("--nonfinite", choices=["stop", "skip"], default="stop",
                   help="on a non-finite loss or gradient norm: stop the run (default), or "
                   "skip that update and say so")
    p.add_argument("--log-json", metavar="FILE", help="also append each step as JSON to FILE")


def check_output(flag: str, path: str | None, *, directory: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written: a file (--trace,
    --log-json) whose directory is missing, or that is a directory; a checkpoint directory
    (--save) that is a file, or whose parent is missing. The OS still has the last word."""
    if not path:
        return
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        raise UserError(f"{flag} {path}: " + ("not a directory" if directory else
                                              "is a directory, not a file"))
    parent = p.parent if not p.exists() else p if directory else p.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: " + (f"no such directory {parent}" if not
                                              parent.exists() else f"{parent} is not a directory"))
    if not os.access(p if p.exists() else parent, os.W_OK):
        raise UserError(f"{flag} {path}: not writable (permission denied)")


def _run(args) -> int:
    from schedc.train import run_command

    return run_command(args)


COMMANDS["run"] = (_run_args, _run, "train: run a schedule under torchrun (world 1: alone)")


# -- render and calibrate (Graphviz drawings and the cost model; no torch) ------------------------


def _render_args(p: argparse.ArgumentParser) -> None:
    from schedc.render import add_render_args

    add_render_args(p)


def _render(args) -> int:
    from schedc.render import render_command

    return render_command(args)


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    from schedc.render import add_calibrate_args

    add_calibrate_args(p)


def _calibrate(args) -> int:
    from schedc.render import calibrate_command

    return calibrate_command(args)


COMMANDS["render"] = (_render_args, _render,
                      "draw the dependency graph or a predicted/measured timeline (Graphviz)")
COMMANDS["calibrate"] = (_calibrate_args, _calibrate,
                         "fit the render cost model to a `schedc run --trace` file")
