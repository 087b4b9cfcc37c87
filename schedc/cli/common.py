"""What the verbs share: the flags that override a schedule's own values."""

from __future__ import annotations

import argparse

from schedc.lang.resolve import Overrides


def overrides(args) -> Overrides:
    return Overrides(model=getattr(args, "model", None), steps=getattr(args, "steps", None),
                     seed=getattr(args, "seed", None),
                     precision=getattr(args, "precision", None),
                     tf32=_switch(getattr(args, "tf32", None)),
                     compile=_switch(getattr(args, "compile", None)))


def _switch(value: str | None) -> bool | None:
    return None if value is None else value == "on"


def add_override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model size (overrides the file)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides the file)")
    p.add_argument("--seed", type=int, help="seed (overrides the file)")
    p.add_argument("--precision", metavar="POLICY", help="numerics policy: fp32 or bf16 "
                   "(replaces the file's `precision`)")
    p.add_argument("--tf32", choices=["on", "off"], help="TF32 for fp32 matmuls on CUDA "
                   "(overrides the file; default on with CUDA)")
    p.add_argument("--compile", choices=["on", "off"], help="torch.compile each layer or "
                   "fused run of layers (overrides the file)")
