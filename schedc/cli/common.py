"""What the verbs share: the flags that override a schedule's own values."""

from __future__ import annotations

import argparse

from schedc.lang.resolve import Overrides


def overrides(args) -> Overrides:
    return Overrides(model=getattr(args, "model", None), steps=getattr(args, "steps", None),
                     seed=getattr(args, "seed", None))


def add_override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model size (overrides the file)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides the file)")
    p.add_argument("--seed", type=int, help="seed (overrides the file)")
