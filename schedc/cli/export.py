"""`schedc export`: a checkpoint's weights as a Hugging Face GPT-2 directory.

    schedc export ckpt -o gpt2-out      # ckpt: a --save directory (its latest) or one step

and then, in Python, `transformers.GPT2LMHeadModel.from_pretrained("gpt2-out")`.

Only the flags live here; torch and the checkpoint reader (schedc/exec/) are imported when
the verb runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from schedc.cli.common import check_distinct, check_output
from schedc.errors import UserError

HELP = "write a checkpoint's weights as a Hugging Face GPT-2 (config.json, model.safetensors)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint: a `run --save` directory (the one its `latest` names) or one of "
        "its step_NNNNNNNN directories; DDP, FSDP and one-process checkpoints of any world",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DIR",
        help="the directory to write config.json and model.safetensors into (made if "
        "missing; files of those names in it are replaced), for "
        "transformers.GPT2LMHeadModel.from_pretrained(DIR)",
    )
    p.add_argument(
        "--checkpoint-key",
        metavar="FILE",
        help="the secret the checkpoint was saved with (run --checkpoint-key): its HMAC is "
        "checked before anything is read; a keyed checkpoint is refused without it",
    )


def run(args: argparse.Namespace) -> int:
    _outside(args.output, args.checkpoint)
    check_output("-o", args.output, directory=True)
    check_distinct(
        ("-o", args.output),
        inputs=(("the checkpoint", args.checkpoint), ("--checkpoint-key", args.checkpoint_key)),
    )
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError(
            "`schedc export` reads checkpoints with torch, which is not installed here; "
            "scripts/install.sh installs it"
        ) from None
    from schedc.exec.checkpoint.files import read_key
    from schedc.exec.checkpoint.layout import CheckpointError
    from schedc.exec.hf import export

    try:
        key = read_key(args.checkpoint_key) if args.checkpoint_key else None
    except CheckpointError as e:
        raise UserError(f"--checkpoint-key {e}") from None
    print(export(args.checkpoint, Path(args.output), key))
    return 0


def _outside(output: str, checkpoint: str) -> None:
    """-o must not lie inside the checkpoint directory it exports (nor be it): the files
    would be written into the checkpoint. Told from the resolved paths (a link to inside
    it is inside it), before anything is written there, check_output's probe included."""
    try:
        out, ck = Path(os.path.realpath(output)), Path(os.path.realpath(checkpoint))
    except (OSError, ValueError):  # a NUL, a name too long: check_output says which
        return
    if out == ck or ck in out.parents:
        raise UserError(
            f"-o {output}: inside the checkpoint {checkpoint}, which an export must leave as "
            "it is; write elsewhere"
        )
