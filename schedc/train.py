"""`schedc run`: train a compiled schedule under torchrun, and end cleanly when anything fails.

    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp_overlap.sched \
        --save ckpt --save-every 10 --timeout 60
    torchrun ... -m schedc run schedules/tiny_ddp_overlap.sched --resume ckpt

Before step 1 every rank proves it runs the same thing as the others: the same schedule
text, the same collective order, the same world, the same data. During the run, a rank
that fails (a dead peer, a peer that stops answering within --timeout, an error in an
instruction) writes where it was to the rendezvous store, reads what the others wrote,
names the ranks that said nothing, and exits 1; torchrun then ends the job. Non-finite
losses or gradient norms stop the run with the step and micro-step named (or, with
`--nonfinite skip`, skip that update and say so). Checkpoints (schedc/checkpoint.py) are
complete or absent.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from schedc.compiler import Compiled
from schedc.data import fingerprint, load_batches
from schedc.lower import Plan
from schedc.reference import format_log
from schedc.run import Comm, Executor, PlanError, RunError, RunOptions, pick_device

FAILURE_GRACE_S = 3.0  # how long a failing rank waits to hear from the others


def agree_at_startup(compiled: Compiled, comm: Comm, plan: Plan, data: str) -> None:
    """Every rank compiled the same schedule into the same collectives and reads the same
    data, or none starts."""
    mine = {
        "rank": comm.rank,
        "schedule": hashlib.sha256(compiled.source.text.encode()).hexdigest()[:16],
        "path": compiled.source.path,
        "collectives": plan.collective_digest(),
        "world": compiled.spec.world,
        "steps": compiled.spec.steps,
        "model": compiled.spec.model_name,
        "data": data,
    }
    everyone: list[dict] = [None] * comm.world
    dist.all_gather_object(everyone, mine, group=comm.group)
    base = everyone[0]
    for other in everyone[1:]:
        diff = [k for k in ("schedule", "collectives", "world", "steps", "model", "data")
                if other[k] != base[k]]
        if diff:
            what = ", ".join(f"{k} {base[k]} vs {other[k]}" for k in diff)
            raise RunError(f"ranks disagree before step 1: rank 0 compiled {base['path']} and "
                           f"rank {other['rank']} compiled {other['path']} ({what}); every "
                           "rank must run the same schedule on the same data")


def run_main(compiled: Compiled, opts: RunOptions, args) -> int:
    """Train for the schedule's steps under torchrun (or alone, at world 1)."""
    from schedc import checkpoint

    device = pick_device(opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # timeouts end the job
    spec = compiled.spec
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != spec.world:
        how = (f"torchrun --standalone --nproc_per_node={spec.world} -m schedc run "
               f"{compiled.source.path}")
        raise RunError(f"{compiled.source.path} is a world-{spec.world} schedule, but this job "
                       f"has {world_env} rank{'s' if world_env != 1 else ''}; run: {how}")
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    comm = Comm.from_env("nccl" if device.type == "cuda" else "gloo", opts.timeout_s)
    where = "start-up"
    try:
        batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        # agree first: building the executor creates a process group per stream, which would
        # wait forever for a rank whose schedule has other streams
        agree_at_startup(compiled, comm, compiled.plan(comm.rank), fingerprint(batches.tokens))
        ex = Executor(compiled, comm, opts, batches)
        if args.resume:
            where = f"loading {args.resume}"
            step = checkpoint.load(ex, args.resume, key=args.key)
            log(comm, f"schedc: resumed from {checkpoint.find(args.resume)} at step {step}")
        log(comm, f"schedc: {compiled.source.path}: {spec.kind}, world {spec.world}, "
            f"{spec.accum} micro-step(s) of {spec.micro} x {spec.seq_len}, {spec.steps} steps "
            f"on {device.type} ({torch.get_num_threads()} thread(s) per rank)")
        records = open(args.log_json, "a") if args.log_json and comm.rank == 0 else None
        while ex.step_index < spec.steps:
            where = f"step {ex.step_index}"
            st = ex.step()
            if st.skipped:
                log(comm, f"step {st.step:4d} | skipped: {st.skipped}")
            else:
                log(comm, format_log(st.step, st.loss, st.lr, st.grad_norm, st.dt_ms,
                                     st.tokens_per_s, mfu(spec, st.tokens_per_s, device)))
            if records:
                records.write(json.dumps({"step": st.step, "loss": st.loss, "lr": st.lr,
                                          "grad_norm": st.grad_norm, "dt_ms": st.dt_ms,
                                          "skipped": st.skipped}) + "\n")
                records.flush()
            if args.save and (ex.step_index % args.save_every == 0
                              or ex.step_index == spec.steps):
                where = f"saving step {ex.step_index}"
                path = checkpoint.save(ex, args.save, keep=args.keep, key=args.key)
                log(comm, f"schedc: checkpoint {path}")
        ex.close()
        if args.trace:
            write_trace(args.trace, ex, comm)
        if comm.rank == 0 and opts.log:
            report_memory(compiled, ex)
    except KeyboardInterrupt:
        raise
    except (checkpoint.CheckpointError, RunError) as e:
        if isinstance(e, PlanError) or world_env > 1 and not isinstance(
                e, checkpoint.CheckpointError):
            fail(comm, str(e), where)
        if isinstance(e, checkpoint.CheckpointError):
            raise  # a user error: run_command prints it as one line, exit 1
        raise RunError(str(e)) from None
    except Exception as e:  # a collective that timed out or lost its peer, mostly
        fail(comm, f"{type(e).__name__}: {e}", where)
    dist.destroy_process_group()
    return 0


# Dense peak FLOP/s by device name, for MFU (bf16 tensor cores, as nanoGPT reports MFU;
# schedc trains in fp32, so its MFU reads low against these). SCHEDC_PEAK_FLOPS overrides.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
              "V100": 125e12, "4090": 165e12}


def mfu(spec, tokens_per_s: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation of all ranks together: 6N + 12 L C T FLOPs per token (PaLM's
    estimate; N counts every parameter, where nanoGPT leaves out wpe) over the peak of D
    devices; None on a CPU or an unknown device."""
    if device.type != "cuda":
        return None
    peak = float(os.environ.get("SCHEDC_PEAK_FLOPS", 0)) or next(
        (v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), 0.0)
    if not peak:
        return None
    cfg = spec.model
    per_token = 6 * cfg.numel + 12 * cfg.n_layer * cfg.n_embd * spec.seq_len
    return per_token * tokens_per_s / (peak * spec.world)


def fail(comm: Comm, what: str, where: str) -> None:
    """Tell the others where this rank stopped, name those that say nothing, and exit 1.

    Exits with os._exit: after a collective failed, gloo and NCCL threads may be blocked
    for good, and a normal interpreter exit could wait on them. No hang, ever.
    """
    silent: list[int] = []
    heard: dict[int, str] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"schedc/failed/{comm.rank}", f"{where}: {what.splitlines()[0][:300]}")
        deadline = time.monotonic() + FAILURE_GRACE_S
        for r in range(comm.world):
            if r == comm.rank:
                continue
            key = f"schedc/failed/{r}"
            left = max(0.05, deadline - time.monotonic())
            try:
                store.wait([key], datetime.timedelta(seconds=left))
                heard[r] = store.get(key).decode()
            except Exception:  # noqa: BLE001 - a rank that never wrote is the answer
                silent.append(r)
    except Exception:  # noqa: BLE001 - the store is gone too (its host died)
        silent = [r for r in range(comm.world) if r != comm.rank]
        heard = {}
    lines = [f"schedc: error on rank {comm.rank} ({where}): {what}"]
    if silent:
        who = ", ".join(str(r) for r in silent)
        lines.append(f"schedc: rank {comm.rank}: rank{'s' if len(silent) > 1 else ''} {who} "
                     f"stopped answering (dead, or stuck past --timeout "
                     f"{comm.timeout.total_seconds():.0f}s); nothing from "
                     f"{'them' if len(silent) > 1 else 'it'} in {FAILURE_GRACE_S:.0f}s")
    for r, text in sorted(heard.items()):
        lines.append(f"schedc: rank {comm.rank}: rank {r} failed too, at {text}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def log(comm: Comm, text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def write_trace(path: str, ex: Executor, comm: Comm) -> None:
    mine = ex.trace_events()
    if comm.world > 1:
        every: list = [None] * comm.world
        dist.all_gather_object(every, mine, group=comm.group)
        events = [e for part in every for e in part]
    else:
        events = mine
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"schedule": ex.compiled.source.path}}, f)
        print(f"schedc: trace written to {path} ({len(events)} events)", flush=True)


def report_memory(compiled: Compiled, ex: Executor) -> None:
    from schedc.check import fmt_bytes

    pred, meas = compiled.memory, ex.memory()
    rows = [("model states", pred.states, meas["states"]),
            ("gathered units (peak)", pred.gathered_peak, meas["gathered_peak"]),
            ("unsharded grads (peak)", pred.grads_peak, meas["grads_peak"])]
    text = "; ".join(f"{name} {fmt_bytes(p)} predicted, {fmt_bytes(m)} measured"
                     for name, p, m in rows if p or m)
    if "cuda_max_allocated" in meas:
        text += f"; cuda max allocated {fmt_bytes(meas['cuda_max_allocated'])}"
    print(f"schedc: memory per rank: {text}", file=sys.stderr, flush=True)


def run_command(args) -> int:
    from schedc.commands import overrides
    from schedc.compiler import compile_file
    from schedc.resources import default_schedule

    if args.save_every < 1:
        from schedc.commands import UserError

        raise UserError("--save-every must be at least 1")
    from schedc import checkpoint
    from schedc.commands import UserError

    try:  # read before training, so a bad key file fails at once
        args.key = checkpoint.read_key(args.checkpoint_key) if args.checkpoint_key else None
    except checkpoint.CheckpointError as e:
        raise UserError(f"--checkpoint-key {e}") from None
    path = args.file or str(default_schedule())
    compiled = compile_file(path, overrides(args))
    opts = RunOptions(device=args.device, timeout_s=args.timeout, trace=bool(args.trace),
                      nonfinite=args.nonfinite)
    try:
        return run_main(compiled, opts, args)
    except RunError as e:
        rank = os.environ.get("RANK", "0")
        print(f"schedc: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except checkpoint.CheckpointError as e:
        raise UserError(str(e)) from None  # `schedc: error: DIR/FILE: ...`, exit 1

