"""`schedc run`: train a schedule. On one node it starts the file's ranks itself
(exec/launcher.py); under torchrun (several nodes) each rank runs it; world 1 runs alone.

Only the flags live here; the executor (schedc/exec/) is imported when the verb runs, so
building the parser for any verb never imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from schedc.cli.common import (
    COUNT,
    POSITIVE,
    TIMEOUT_S,
    add_override_args,
    check_distinct,
    check_output,
    defaults,
    overrides,
    require,
)
from schedc.compiler import compile_file
from schedc.errors import UserError
from schedc.lang.resources import default_schedule
from schedc.model.hf import CONFIG, check_config, parse_init, read_config, weights_file

HELP = "train: run a schedule (its ranks started here, or under torchrun)"

# (flag, the flag it needs, what it does): alone, it would be silently ignored
NEEDS = [
    ("--probe", "--trace", "times collectives and layers for the trace"),
    ("--save-every", "--save", "says how often --save writes a checkpoint"),
    ("--keep", "--save", "says how many checkpoints --save keeps"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file",
        nargs="?",
        metavar="FILE.sched",
        help='the schedule (default: the bundled tiny_ddp_overlap.sched); a `data "path"` '
        "in it is read relative to the working directory",
    )
    add_override_args(p)
    p.add_argument(
        "--val-every",
        type=COUNT,
        metavar="N",
        help="validation loss after every N steps and the last, over the `val` shards "
        "(overrides the file's `eval { val_every }`; 0: none)",
    )
    p.add_argument(
        "--sample-every",
        type=COUNT,
        metavar="N",
        help="rank 0 logs samples of the model after every N steps and the last: top-k 50 "
        "completions of the prompt, as build-nanogpt (overrides `eval { sample_every }`; "
        "0: none; needs a GPT-2 vocabulary)",
    )
    p.add_argument(
        "--hellaswag",
        metavar="FILE.jsonl",
        help="score HellaSwag's acc_norm on this local .jsonl (build-nanogpt's way; nothing "
        "is downloaded) after every --hellaswag-every steps and the last (overrides "
        "`eval { hellaswag }`)",
    )
    p.add_argument(
        "--hellaswag-every",
        type=COUNT,
        metavar="N",
        help="score HellaSwag after every N steps and the last (overrides "
        "`eval { hellaswag_every }`; default 250; 0: none)",
    )
    _add_process_args(p)
    _add_checkpoint_args(p)
    _add_step_args(p)


def _add_process_args(p: argparse.ArgumentParser) -> None:
    """Where the ranks run, what they trace, how long they wait for each other."""
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where to train: cuda (one GPU per rank, LOCAL_RANK's; NCCL), cpu (gloo; "
        "OMP_NUM_THREADS threads per rank if set, else 1 per rank when a node runs several, "
        "all cores at world 1), or auto (default): cuda when torch sees a GPU, else cpu",
    )
    p.add_argument(
        "--trace",
        metavar="OUT.json",
        help="write a Chrome/Perfetto trace of every step (one track per rank and stream; "
        "`schedc render --trace` and `schedc calibrate` read it)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="with --trace: first time all-reduce, all-gather and reduce-scatter on the "
        "world's group at 1, 4 and 16 MiB (about a second on gloo), and the forward and "
        "backward of embed, one block and head at micro 1 and the schedule's micro (twice "
        "each, after one to warm up), so that "
        "`schedc calibrate` prices the collective kinds and micro sizes this schedule does "
        "not run",
    )
    p.add_argument(
        "--timeout",
        type=TIMEOUT_S,
        default=300.0,
        metavar="S",
        help="seconds a rank waits for the others before failing (default 300)",
    )


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Checkpoints: where they are written, how often, how many kept, what resumes."""
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR")
    p.add_argument(
        "--save-every",
        type=POSITIVE,
        metavar="N",
        help="checkpoint every N steps, and after the last (default 100)",
    )
    p.add_argument(
        "--keep",
        type=COUNT,
        metavar="N",
        help="with --save: the newest N checkpoints are kept, older ones deleted "
        "(default 2; 0 keeps every one)",
    )
    p.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    p.add_argument(
        "--init",
        metavar="hf:DIR",
        help="start from a local Hugging Face GPT-2 (DIR/config.json and model.safetensors, "
        "or a weights-only pytorch_model.bin) instead of the seed's weights; its sizes must "
        "be the schedule's model's (not with --resume)",
    )
    p.add_argument(
        "--checkpoint-key",
        metavar="FILE",
        help="a secret (16-4096 bytes): --save "
        "signs meta.json with its HMAC-SHA256, --resume refuses a checkpoint whose "
        "HMAC is missing or wrong (README, Robustness)",
    )


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """What a step with a non-finite loss does, and where every step is logged."""
    p.add_argument(
        "--nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="on a non-finite loss or gradient norm: stop the run (default), or "
        "skip that update and say so",
    )
    p.add_argument(
        "--log-json",
        metavar="FILE",
        help="also append each step to FILE as one JSON object a line: step, loss, lr, "
        "grad_norm, dt_ms, tokens_per_s, skipped (a boolean), skip_reason, mfu (where known); "
        "and each evaluation: val_loss, hellaswag_acc_norm, or a sample's text",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="rank 0 also writes the step's and evaluations' numbers (loss, lr, grad norm, "
        "tokens/s, MFU where known, val loss, HellaSwag acc_norm) as TensorBoard scalars "
        "into DIR (`tensorboard --logdir DIR`)",
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """The outputs other than --trace writable, none of them another's path or an input."""
    check_output("--log-json", args.log_json)
    check_output("--save", args.save, directory=True)
    check_output("--tensorboard", args.tensorboard, directory=True)
    check_distinct(
        ("--trace", args.trace),
        ("--log-json", args.log_json),
        ("--save", args.save),
        ("--tensorboard", args.tensorboard),
        inputs=(
            ("the schedule", args.file or str(default_schedule())),
            ("--checkpoint-key", args.checkpoint_key),
            ("--hellaswag", args.hellaswag),
        ),
    )
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "--tensorboard writes with torch.utils.tensorboard, which needs the tensorboard "
            "package: pip install tensorboard"
        )


def _check_flags(args: argparse.Namespace) -> None:
    """Flag values first (the number types above checked the numbers), before any work: a bad
    --trace or --log-json path fails before training, not after it."""
    for flag, value in (
        ("--resume", args.resume),
        ("--checkpoint-key", args.checkpoint_key),
        ("--hellaswag", args.hellaswag),
    ):
        if value is not None and not value.strip():
            raise UserError(f"{flag}: the path is empty")
    check_output("--trace", args.trace)
    require(args, NEEDS)
    defaults(args, save_every=100, keep=2)
    _check_outputs(args)


def _need_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError(
            "`schedc run` trains with torch, which is not installed here; "
            "scripts/install.sh installs it (check and render need no torch)"
        ) from None


def run(args: argparse.Namespace) -> int:
    ov = overrides(args)
    _check_flags(args)
    # the proof runs once a job: in the launching process, and on rank 0, which refuses to
    # start if it fails; every other rank binds its own plan only, and all agree on the
    # plans' digest before step 1 (exec/train.py), so rank 0's proof covers theirs
    prover = os.environ.get("RANK", "0") == "0"
    compiled = compile_file(args.file or str(default_schedule()), ov, prove=prover)
    if compiled.pipeline is not None:
        refuse_for_pipeline(args, compiled)
    init = _init_dir(args, compiled.spec)
    _need_torch()
    from schedc.exec.launcher import start_ranks

    if compiled.spec.world > 1 and "RANK" not in os.environ:  # not a rank: start them
        return start_ranks(compiled.spec.world, args.argv)
    from schedc.exec.checkpoint.files import read_key
    from schedc.exec.checkpoint.layout import CheckpointError
    from schedc.exec.options import RunOptions
    from schedc.exec.train import TrainOptions, run_main

    try:  # read before training, so a bad key file fails at once
        key = read_key(args.checkpoint_key) if args.checkpoint_key else None
    except CheckpointError as e:
        raise UserError(f"--checkpoint-key {e}") from None
    opts = RunOptions(
        device=args.device,
        timeout_s=args.timeout,
        trace=bool(args.trace),
        probe=args.probe,
        nonfinite=args.nonfinite,
        heap=True,  # CPU: predicted vs measured peak at the end (a thread reads it every ms)
    )
    job = TrainOptions(
        save=args.save,
        save_every=args.save_every,
        keep=args.keep,
        resume=args.resume,
        log_json=args.log_json,
        trace=args.trace,
        tensorboard=args.tensorboard,
        key=key,
        init=init,
    )
    if compiled.pipeline is not None:
        from schedc.exec.pipeline_train import run_pipeline

        return run_pipeline(compiled, opts, job)
    return run_main(compiled, opts, job)


# what a pipeline run does not do yet: (flag, given?) -- each refused, not ignored
PIPELINE_NOT_YET = (
    ("--probe", lambda a: a.probe),
    ("--device cuda", lambda a: a.device == "cuda"),
)


def refuse_for_pipeline(args: argparse.Namespace, compiled) -> None:
    """A pipeline schedule runs on CPU ranks, eager (in fp32 or its precision policy), without
    probes or checkpoints of HSDP per stage yet (exec/pipeline_train.py): anything else asked is
    a user error, not silently dropped."""
    path, spec = compiled.source.path, compiled.spec
    asked = [flag for flag, given in PIPELINE_NOT_YET if given(args)]
    if spec.pipeline.units and spec.declared_mesh is not None:  # a 2-D stage mesh: not yet
        asked += [f"{flag} (of HSDP per stage)" for flag in ("--save", "--resume")
                  if getattr(args, flag[2:])]  # fmt: skip
    n = spec.numerics
    if n.compile or n.loss_chunk is not None:
        asked.append("`compile` and `loss chunk`")
    if asked:
        raise UserError(
            f"{path} is a pipeline schedule, whose runs do not take {', '.join(asked)} yet: "
            "a pipeline runs on CPU ranks, eager, logging its steps (--log-json, --tensorboard)"
        )


def _init_dir(args: argparse.Namespace, spec) -> str | None:
    """--init hf:DIR's directory, its config.json held to the schedule's model before torch
    is imported (the weights are read once the ranks agree on them: exec/train.py)."""
    if args.init is None:
        return None
    if args.resume:
        raise UserError(
            f"--init {args.init} and --resume {args.resume}: a resumed run continues from "
            "its checkpoint's weights; give one of them"
        )
    directory = parse_init(args.init)
    config = read_config(directory)
    check_config(config, directory / CONFIG, spec.model, spec.model_name)
    weights_file(directory, spec.model)  # there, a regular file, of a size the model can have
    return str(directory)
