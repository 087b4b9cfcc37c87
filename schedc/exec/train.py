"""`schedc run`: train a compiled schedule under torchrun, and end cleanly when anything fails.

    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp_overlap.sched \
        --save ckpt --save-every 10 --timeout 60
    torchrun ... -m schedc run schedules/tiny_ddp_overlap.sched --resume ckpt

Before step 1 every rank proves it runs the same thing as the others: the same schedule
meaning (not text), the same collective order, the same data, the same resume checkpoint
and step, save settings and run flags. During the run, a rank
that fails (a dead peer, a peer that stops answering within --timeout, an error in an
instruction) writes where it was to the rendezvous store, reads what the others wrote,
names the ranks that said nothing, and exits 1; torchrun then ends the job. Non-finite
losses or gradient norms stop the run with the step and micro-step named (or, with
`--nonfinite skip`, skip that update and say so). Checkpoints (schedc/exec/checkpoint.py) are
complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import trace_file
from schedc.compiler import Compiled
from schedc.errors import RunError
from schedc.exec.backends import nccl_launch_order
from schedc.exec.executor import Executor, PlanError, collective_streams
from schedc.exec.heap import keep_freed_memory
from schedc.exec.heartbeat import STALE_S, Heartbeat
from schedc.exec.launcher import tell_launcher
from schedc.exec.options import Comm, RunOptions, pick_device
from schedc.ir.plan import Action, Plan
from schedc.model.data import CORPUS, DataError, fingerprint, load_batches
from schedc.model.reference import fmt_eta, format_log, step_label


@dataclass(frozen=True)
class TrainOptions:
    """What a run does besides the schedule's step: checkpoints, logs, traces (built by
    cli/run.py from the flags, which it has already checked)."""

    save: str | None = None  # a checkpoint directory
    save_every: int = 100
    keep: int = 2  # checkpoints kept; 0: every one
    resume: str | None = None
    log_json: str | None = None
    trace: str | None = None
    key: bytes | None = None  # --checkpoint-key: save signs meta.json, resume checks it


FAILURE_GRACE_S = 3.0  # how long a failing rank waits to hear from the others
TERM_STORE_S = 1.0  # how long a rank terminated by torchrun asks the store who failed
TERM_EXIT = 143  # 128 + SIGTERM: ended by the launcher (1: this rank failed by itself)


def agree_at_startup(
    compiled: Compiled, comm: Comm, plan: Plan, data: str, flags: dict[str, str] | None = None
) -> None:
    """Every rank runs the same thing, or none starts: the schedule's meaning (agree.meaning:
    model, batch, steps, seed after flags, resolved data source, optimizer, strategy; not its
    text, so comments and spelling may differ), the same collectives in the same order, the
    same data (a fingerprint of the tokens read), and the same run flags (`flags`: resume
    source and step, save settings, --nonfinite, --probe, --trace, device, master dtype).
    The meaning covers every field of the resolved schedule, so the numerics, recompute and
    the mesh after --precision, --tf32 and --compile are compared too. A difference is named
    by field and rank on every rank: `seed 1 on rank 0, 2 on rank 1`."""
    from schedc.passes.agree import meaning

    mine = {
        "rank": comm.rank,
        "path": compiled.source.path,
        "fields": {
            **meaning(compiled.spec),
            "collectives": plan.collective_digest(),
            "data": data,
            **(flags or {}),
        },
    }
    everyone: list[dict] = [None] * comm.world
    dist.all_gather_object(everyone, mine, group=comm.group)
    base = everyone[0]["fields"]
    what = []
    for other in everyone[1:]:
        f = other["fields"]
        what += [
            f"{k} {_short(k, base.get(k))} on rank 0, {_short(k, f.get(k))} on rank {other['rank']}"
            for k in dict.fromkeys([*base, *f])
            if base.get(k) != f.get(k)
        ]
    if what:
        paths = {e["path"] for e in everyone}
        ran = f" (rank 0 runs {everyone[0]['path']})" if len(paths) > 1 else ""
        raise RunError(
            f"ranks disagree before step 1{ran}: {'; '.join(what)}; every rank must "
            "run the same schedule on the same data with the same flags"
        )


def _short(key: str, v) -> str:
    """A field's value for a message: whole when short or a flag (paths are shown whole),
    else its start and a hash (a strategy lists every parameter)."""
    v = str(v)
    if key.startswith("--"):
        return v
    digest = hashlib.sha256(v.encode()).hexdigest()[:8]
    return v if len(v) <= 60 else f"{v[:40]}... (sha256 {digest})"


def run_flags(job: TrainOptions, device: torch.device, opts: RunOptions) -> dict[str, str]:
    """The run flags every rank must share, resolved: the checkpoint --resume names and its
    step (read from its meta.json now, before any collective: a rank that resumes alone
    would otherwise wait in DCP's collectives for the others until --timeout), the save
    directory and cadence, what to do on a non-finite loss, the device type, the precision."""
    from schedc.exec.checkpoint import CheckpointError, find, read_meta

    resume = "none"
    if job.resume:
        try:
            # bounded, a regular file only, its HMAC checked first with --checkpoint-key
            path = find(job.resume)
            step = read_meta(path, job.key)["step"]
            resume = f"{path.resolve()} (step {step})"
        except (CheckpointError, OSError) as e:
            resume = f"unusable: {e}"  # said after agreement, by every rank that has it
    save = "none"
    if job.save:
        save = f"{os.path.abspath(job.save)} every {job.save_every}, keep {job.keep}"
    return {
        "--resume": resume,
        "--save": save,
        "--nonfinite": opts.nonfinite,
        "--probe": "on" if opts.probe else "off",  # collectives: on every rank, or none
        # a trace synchronizes every step and gathers its spans at the end: all ranks or none
        "--trace": "on" if job.trace else "off",
        "device": device.type,
        "master dtype": str(opts.dtype).removeprefix("torch."),
    }


def data_error(e: DataError, source) -> str:
    """A data file that cannot be read, and, when the schedule named it by a relative path
    that does not exist, where schedc looked: the working directory, not the schedule's."""
    text = str(e)
    path = Path(str(source))
    if str(source) != CORPUS and not path.is_absolute() and not path.exists():
        text += (
            f" (a relative `data` path is read from the working directory, {os.getcwd()}, "
            "not from the schedule's directory: run from there, or write an absolute path)"
        )
    return text


def check_gpus(local_world: int, device_count: int) -> None:
    """More ranks on this node than it has GPUs would put two ranks on one device, and NCCL
    refuses that only later, with a stack of errors on every rank: say it first, in one line."""
    if local_world > device_count:
        raise RunError(
            f"this node runs {local_world} ranks but has {device_count} GPU"
            f"{'s' if device_count != 1 else ''} (torch.cuda.device_count()); "
            f"run at most {device_count} per node (torchrun --nproc_per_node), "
            "or --device cpu"
        )


def run_main(compiled: Compiled, opts: RunOptions, job: TrainOptions) -> int:
    """Train for the schedule's steps under torchrun (or alone, at world 1)."""
    from schedc.exec import checkpoint

    device = pick_device(opts.device)
    if device.type == "cuda":
        check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # timeouts end the job
    spec = compiled.spec
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != spec.world:
        how = (
            f"torchrun --standalone --nproc_per_node={spec.world} -m schedc run "
            f"{compiled.source.path}"
        )
        raise RunError(
            f"{compiled.source.path} is a world-{spec.world} schedule, but this job "
            f"has {world_env} rank{'s' if world_env != 1 else ''}; run: {how}"
        )
    if spec.hsdp and (job.save or job.resume):
        # the checkpoint lays a unit's shards out over the whole world (one DTensor dim);
        # an HSDP shard is one of S, held by R ranks: refused, not saved wrongly
        raise RunError(
            f"{compiled.source.path}: checkpoints (--save, --resume) of HSDP schedules "
            f"(mesh {spec.mesh}) are not supported yet; run without them, or without the mesh"
        )
    threads = ""
    if device.type == "cpu":
        threads = cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        keep_freed_memory()  # else page faults cost a fifth of a CPU step (exec/heap.py)
    if device.type == "cuda":  # before the first NCCL communicator exists
        nccl_launch_order(len(collective_streams(compiled.plan(int(os.environ.get("RANK", 0))))))
    comm = Comm.from_env("nccl" if device.type == "cuda" else "gloo", opts.timeout_s)
    where = _here("start-up")
    watch_sigterm(comm)
    beats = Heartbeat(
        comm.rank,
        comm.world,
        min(STALE_S, opts.timeout_s),
        lambda: plan_position(_now["ex"]),
        lambda peer, quiet, at: fail(
            comm,
            f"rank {peer} has sent no heartbeat for {quiet:.0f}s, last at {at}: it is stopped "
            "or its host is gone (a slow rank still beats)",
            _now["where"],
        ),
    )
    beats.start()
    try:
        try:
            batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        except DataError as e:
            raise RunError(data_error(e, spec.data.source)) from None
        # agree first: building the executor creates a process group per stream, which would
        # wait forever for a rank whose schedule has other streams
        flags = run_flags(job, device, opts)
        agree_at_startup(
            compiled, comm, compiled.plan(comm.rank), fingerprint(batches.tokens), flags
        )
        if flags["--resume"].startswith("unusable: "):  # the same on every rank: agreed
            raise checkpoint.CheckpointError(flags["--resume"].removeprefix("unusable: "))
        ex = _now["ex"] = Executor(compiled, comm, opts, batches)
        if opts.probe:
            where = _here("probing collectives and layers for the trace")
            ex.probe()
        if job.resume:
            where = _here(f"loading {job.resume}")
            step = checkpoint.load(ex, job.resume, key=job.key)
            log(comm, f"schedc: resumed from {checkpoint.find(job.resume)} at step {step}")
        n = torch.get_num_threads()
        log(
            comm,
            f"schedc: {compiled.source.path}: {spec.kind}, world {spec.world}"
            + (f" as mesh {spec.mesh} (replicate x shard), " if spec.hsdp else ", ")
            + f"{spec.accum} micro-step{'s' if spec.accum != 1 else ''} of {spec.micro} x "
            f"{spec.seq_len}, {spec.steps} step{'s' if spec.steps != 1 else ''} "
            f"on {device.type} ({n} thread{'s' if n != 1 else ''} per rank{threads})",
        )
        records = open(job.log_json, "a") if job.log_json and comm.rank == 0 else None
        clock = RunClock(ex.step_index, spec.steps)
        while ex.step_index < spec.steps:
            where = _here(f"step {ex.step_index}")
            st = ex.step()
            eta = clock.done(st)
            if st.skipped:
                log(
                    comm,
                    f"{step_label(st.step, spec.steps)} | skipped: {st.skipped} | "
                    f"dt {st.dt_ms:.2f}ms | eta {fmt_eta(eta)}",
                )
            else:
                log(
                    comm,
                    format_log(
                        st.step,
                        st.loss,
                        st.lr,
                        st.grad_norm,
                        st.dt_ms,
                        st.tokens_per_s,
                        mfu(spec, st.tokens_per_s, device),
                        steps=spec.steps,
                        eta_s=eta,
                    ),
                )
            if records:
                records.write(json.dumps(log_record(st), allow_nan=False) + "\n")
                records.flush()
            if job.save and (ex.step_index % job.save_every == 0 or ex.step_index == spec.steps):
                where = _here(f"saving step {ex.step_index}")
                path = checkpoint.save(ex, job.save, keep=job.keep, key=job.key)
                log(comm, f"schedc: checkpoint {path}")
        ex.close()
        if job.trace:
            write_trace(job.trace, ex, comm)
        if comm.rank == 0 and opts.log:
            report_memory(compiled, ex)
        log(comm, clock.summary(peak_memory(device)))
    except KeyboardInterrupt:
        raise
    except (checkpoint.CheckpointError, RunError) as e:
        if (
            isinstance(e, PlanError)
            or world_env > 1
            and not isinstance(e, checkpoint.CheckpointError)
        ):
            fail(comm, str(e), where, getattr(e, "cause", None))
        raise  # a user error: the CLI prints it in one line, exit 1
    except Exception as e:  # a collective that timed out or lost its peer, mostly
        fail(comm, f"{type(e).__name__}: {e}", where)
    beats.done()
    dist.destroy_process_group()
    return 0


def cpu_threads(local_world: int) -> str:
    """Set torch's intra-op threads on a CPU run, unless the user chose: OMP_NUM_THREADS
    (torch has read it already; torchrun sets 1 when it starts several ranks and nothing is
    set) is kept as it is. Otherwise 1 thread per rank when a node runs several (torchrun's
    own default, so that a job launched by hand gets the same), all cores at world 1.
    Returns where the count came from, for the start line."""
    if omp := os.environ.get("OMP_NUM_THREADS", "").strip():
        return f", OMP_NUM_THREADS={omp}"  # torch uses at most the cores it has
    torch.set_num_threads(1 if local_world > 1 else max(1, os.cpu_count() or 1))
    return ""


def log_record(st) -> dict:
    """One --log-json line: numbers as JSON numbers (a non-finite one, which JSON cannot
    hold, as null), `skipped` a boolean and `skip_reason` why (null when not skipped)."""

    def num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "step": st.step,
        "loss": num(st.loss),
        "lr": num(st.lr),
        "grad_norm": num(st.grad_norm),
        "dt_ms": num(st.dt_ms),
        "tokens_per_s": num(st.tokens_per_s),
        "skipped": bool(st.skipped),
        "skip_reason": st.skipped or None,
    }


class RunClock:
    """Wall time of a run's steps: the ETA after each, and the summary at the end.

    The first step of a run pays for warm-up (allocations, gloo/NCCL connections, lazy
    initialisation: 2-3x a later step on CPU), so once a later step is done the ETA and the
    mean tokens/s leave it out. The ETA is wall time per step (checkpoints and logging
    included) times the steps left; tokens/s is tokens over the steps' own time (dt)."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps = first, steps
        self.t0 = time.perf_counter()
        self.t_warm: float | None = None  # when the first step ended
        self.stats: list = []

    def done(self, st) -> float:
        """Record a finished step; return the seconds left, estimated."""
        now = time.perf_counter()
        self.stats.append(st)
        if self.t_warm is None:
            self.t_warm = now
            per_step = now - self.t0
        else:
            per_step = (now - self.t_warm) / (len(self.stats) - 1)
        return per_step * (self.steps - 1 - st.step)

    def summary(self, peak: str) -> str:
        """The run in one paragraph: steps, total time, mean tokens/s without the warm-up
        step, final loss, updates skipped, peak memory."""
        if not self.stats:
            return f"schedc: done: nothing to run (resumed at step {self.first} of {self.steps})"
        total = time.perf_counter() - self.t0
        sts, n = self.stats, len(self.stats)
        later = sts[1:] or sts
        tok_s = sum(s.tokens_per_s * s.dt_ms for s in later) / sum(s.dt_ms for s in later)
        which = (
            f"mean over steps {later[0].step}-{later[-1].step} (step {sts[0].step}, the "
            f"warm-up, took {sts[0].dt_ms / 1e3:.2f}s and is left out)"
            if n > 1
            else f"of step {sts[0].step} alone, warm-up included"
        )
        losses = [s.loss for s in sts if not s.skipped]
        final = f"final loss {losses[-1]:.6f}" if losses else "no update made (all skipped)"
        skipped = n - len(losses)
        text = (
            f"schedc: done: {n} step{'s' if n != 1 else ''} ({sts[0].step}-{sts[-1].step}"
            f" of {self.steps}) in {fmt_eta(total)}; {tok_s:,.0f} tokens/s {which}; {final}"
        )
        if skipped:
            text += f"; {skipped} update{'s' if skipped != 1 else ''} skipped (--nonfinite skip)"
        return f"{text}; {peak}" if peak else text


def peak_memory(device: torch.device) -> str:
    """Rank 0's peak memory, as the summary says it: CUDA's max allocated on a GPU, the
    process's peak resident set on a CPU (Linux and macOS), or nothing where unknown."""
    from schedc.passes.memory import fmt_bytes

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        return f"peak CUDA memory allocated {fmt_bytes(peak)} (rank 0)"
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return ""
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return f"peak RSS {fmt_bytes(rss * scale)} (rank 0's process)"


# Dense peak FLOP/s by device name, for MFU (bf16 tensor cores, as nanoGPT reports MFU;
# schedc trains in fp32, so its MFU reads low against these). SCHEDC_PEAK_FLOPS overrides.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
    "4090": 165e12,
}


def mfu(spec, tokens_per_s: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation of all ranks together: 6N + 12 L C T FLOPs per token (PaLM's
    estimate; N counts every parameter, where nanoGPT leaves out wpe) over the peak of D
    devices; None on a CPU or an unknown device."""
    if device.type != "cuda":
        return None
    peak = float(os.environ.get("SCHEDC_PEAK_FLOPS", 0)) or next(
        (v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), 0.0
    )
    if not peak:
        return None
    cfg = spec.model
    per_token = 6 * cfg.numel + 12 * cfg.n_layer * cfg.n_embd * spec.seq_len
    return per_token * tokens_per_s / (peak * spec.world)


def fail(comm: Comm, what: str, where: str, cause: BaseException | None = None) -> None:
    """Tell the others where this rank stopped, name those that say nothing, and exit 1.

    Exits with os._exit: after a collective failed, gloo and NCCL threads may be blocked
    for good, and a normal interpreter exit could wait on them. No hang, ever. Under
    torchrun the SIGTERM that ends the job may arrive during the grace below: then
    `terminated` reports instead, in one line, with this failure in it.
    """
    # the SIGTERM line names the instruction already: of a PlanError it needs the cause only
    _now["failing"] = (
        (f"{type(cause).__name__}: {cause}" if cause else what).strip().split("\n")[0][:200]
    )
    silent: list[int] = []
    heard: dict[int, str] = {}
    woken: list[int] = []
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"schedc/failed/{comm.rank}", f"{where}: {what.splitlines()[0][:300]}")
        # polled in short checks, not one long store.wait: the store client serves one
        # call at a time, and the SIGTERM report (`terminated`) must get a word in
        deadline = time.monotonic() + FAILURE_GRACE_S
        silent = [r for r in range(comm.world) if r != comm.rank]
        while silent:
            for r in list(silent):
                if store.check([f"schedc/failed/{r}"]):
                    heard[r] = store.get(f"schedc/failed/{r}").decode()
                    silent.remove(r)
            if not silent or time.monotonic() > deadline:
                break  # a rank that never wrote is the answer
            time.sleep(0.05)
        woken = wake_stopped(store, silent)
    except Exception:  # noqa: BLE001 - the store is gone too (its host died)
        silent = [r for r in range(comm.world) if r != comm.rank]
        heard = {}
    lines = [f"schedc: error on rank {comm.rank} ({where}): {what}"]
    if silent:
        who = ", ".join(str(r) for r in silent)
        lines.append(
            f"schedc: rank {comm.rank}: rank{'s' if len(silent) > 1 else ''} {who} "
            f"stopped answering (dead, stopped, or stuck past --timeout "
            f"{comm.timeout.total_seconds():.0f}s); nothing from "
            f"{'them' if len(silent) > 1 else 'it'} in {FAILURE_GRACE_S:.0f}s"
        )
    if woken:
        lines.append(
            f"schedc: rank {comm.rank}: rank{'s' if len(woken) > 1 else ''} "
            f"{', '.join(map(str, woken))} {'were' if len(woken) > 1 else 'was'} "
            "stopped (SIGSTOP); sent SIGCONT so that torchrun's SIGTERM can end "
            f"{'them' if len(woken) > 1 else 'it'} now"
        )
    for r, text in sorted(heard.items()):
        lines.append(f"schedc: rank {comm.rank}: rank {r} failed too, at {text}")
    with _report:  # the SIGTERM report, if it came first, exits the process in here
        print("\n".join(lines), file=sys.stderr, flush=True)
        if not silent:  # else a silent peer is the likelier root cause: torchrun names it
            tell_launcher("\n".join(lines))  # under torchrun: shown in its report
        sys.stdout.flush()
        os._exit(1)


# -- a rank that torchrun terminates ------------------------------------------------------------
#
# When one rank dies, torchrun SIGTERMs the others within ~0.1 s, before their own failure
# report (above) is out; Python's default would end them silently. `schedc run` instead
# answers SIGTERM with one line: where this rank was in its plan, and which ranks it had
# heard from, then exits 143. The Python-level handler would run only between bytecodes of
# the main thread, which is usually blocked in C++ (a gloo/NCCL wait, the store), where it
# cannot run; so the signal only writes a byte to a wakeup fd (signal.set_wakeup_fd) and a
# daemon thread, which needs nothing but the GIL the blocked main thread released, reports
# and exits. Every store call in it is bounded (TERM_STORE_S): the store's host may be gone.

_now: dict = {"comm": None, "ex": None, "where": "start-up", "failing": ""}
_report = threading.Lock()  # one report per rank: fail()'s or the SIGTERM one, never both


def _here(where: str) -> str:
    """Record the phase of the run for the SIGTERM report, and return it."""
    _now["where"] = where
    return where


def watch_sigterm(comm: Comm) -> None:
    """Answer SIGTERM with `terminated()`; publish this rank's host and pid for `fail()`."""
    _now["comm"] = comm
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread (schedc's CLI is the main thread)
    try:
        dist.distributed_c10d._get_default_store().set(
            f"schedc/pid/{comm.rank}", f"{socket.gethostname()} {os.getpid()}"
        )
    except Exception:  # noqa: BLE001, S110 - only wake_stopped needs it, and only as a courtesy
        pass
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread below reports
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while os.read(r, 1) != bytes([signal.SIGTERM]):  # SIGINT writes its number too
            pass
        terminated()

    threading.Thread(target=watch, name="schedc-sigterm", daemon=True).start()


def plan_position(ex: Executor | None) -> str:
    """`step 3, instruction 17 (allreduce[b1]@mb1 on stream comm)`: the plan instruction the
    executor is at, in the plan's own text, or the phase of the run between instructions."""
    if ex is None or ex.at is None:
        return _now["where"]
    k, ins, plan = ex.at, ex.plan.instrs[ex.at], ex.plan
    if ins.kind is Action.RUN:
        text = f"{ins.op} on stream {ins.stream}"
    elif ins.kind is Action.WAIT:
        what = plan.producers.get(ins.event, "the step start")
        text = f"wait on stream {ins.stream} for e{ins.event} = {what}"
    else:
        what = plan.producers.get(ins.event, "the step start")
        text = f"record e{ins.event} on stream {ins.stream} after {what}"
    return f"step {ex.step_index}, instruction {k} ({text})"


def terminated() -> None:
    """SIGTERM (torchrun ending the job): one line naming where this rank was and which
    ranks it had heard from, written to the store as well; then exit TERM_EXIT."""
    comm = _now["comm"]
    where = plan_position(_now["ex"])
    mine = f"{where}: terminated by SIGTERM"
    others = [r for r in range(comm.world) if r != comm.rank]
    heard: dict[int, str] = {}
    answered: list[bool] = []
    woken: list[int] = []

    def ask() -> None:  # in a thread of its own: a store whose host died blocks, not fails
        store = dist.distributed_c10d._get_default_store()
        store.set(f"schedc/failed/{comm.rank}", mine)  # a failing peer hears from us
        for r in others:
            if store.check([f"schedc/failed/{r}"]):
                heard[r] = store.get(f"schedc/failed/{r}").decode()
        answered.append(True)
        woken.extend(wake_stopped(store, [r for r in others if r not in heard]))

    asker = threading.Thread(target=ask, name="schedc-sigterm-store", daemon=True)
    asker.start()
    asker.join(TERM_STORE_S)
    got = dict(heard)
    if got:
        news = "; ".join(f"rank {r} at {t[:120]}" for r, t in sorted(got.items()))
        told = f"heard from {news}"
    else:
        told = "heard from no rank"
    silent = [r for r in others if r not in got]
    if silent and answered:
        told += f"; nothing from rank{'s' if len(silent) > 1 else ''} " + ", ".join(
            map(str, silent)
        )
    elif not answered:
        told += f" (the rendezvous store did not answer within {TERM_STORE_S:.0f}s)"
    if woken:
        told += "; sent SIGCONT to stopped rank " + ", ".join(map(str, woken))
    failing = f", while failing: {_now['failing']}" if _now["failing"] else ""
    told = f"; {told}" if others else ""  # world 1: no one to hear from
    line = f"schedc: rank {comm.rank} terminated by SIGTERM at {where}{failing}{told}\n"
    with _report:
        os.write(2, line.encode(errors="replace"))  # unbuffered: no lock the main thread holds
        os._exit(TERM_EXIT)


def wake_stopped(store, silent: list[int]) -> list[int]:
    """SIGCONT the silent ranks that are stopped (SIGSTOP, ^Z) processes beside this one.

    torchrun ends a job by SIGTERM, then waits 30 s (its --shutdown-timeout) before
    SIGKILL; a stopped process cannot act on SIGTERM, so one stopped rank made every such
    job take 30 s more. Continued, it takes the pending SIGTERM at once (and reports where
    it was), or fails on its own on its dead peer. Only a process that is stopped ('T' in
    /proc/PID/stat, not traced) and a sibling of this one (same parent: the same torchrun
    agent, or the same launcher) on this host is signalled, so a reused pid is never touched;
    SIGCONT does nothing to a running process anyway. Returns the ranks woken.
    """
    woken = []
    for r in silent:
        try:
            key = f"schedc/pid/{r}"
            if not store.check([key]):
                continue
            host, pid = store.get(key).decode().split()
            if host != socket.gethostname():
                continue
            with open(f"/proc/{int(pid)}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if state == "T" and int(ppid) == os.getppid():
                os.kill(int(pid), signal.SIGCONT)
                woken.append(r)
        except Exception:  # noqa: BLE001, S112 - best effort: torchrun's timeout is the fallback
            continue
    return woken


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
            json.dump(trace_file(events, ex.compiled.source.path), f)
        print(f"schedc: trace written to {path} ({len(events)} events)", flush=True)


def report_memory(compiled: Compiled, ex: Executor) -> None:
    from schedc.passes.memory import fmt_bytes

    pred, meas = compiled.memory, ex.memory()
    rows = [
        ("model states", pred.states, meas["states"]),
        ("gathered units (peak)", pred.gathered_peak, meas["gathered_peak"]),
        ("unsharded grads (peak)", pred.grads_peak, meas["grads_peak"]),
    ]
    text = "; ".join(
        f"{name} {fmt_bytes(p)} predicted, {fmt_bytes(m)} measured" for name, p, m in rows if p or m
    )
    if meas.get("heap_peak"):  # CPU: live heap over the steps after the first
        text += (
            f"; peak (states, buffers, activations) {fmt_bytes(pred.peak)} predicted, "
            f"{fmt_bytes(meas['heap_peak'])} measured (live heap)"
        )
    if "cuda_max_allocated" in meas:
        text += (
            f"; cuda max allocated {fmt_bytes(meas['cuda_max_allocated'])}, max reserved "
            f"{fmt_bytes(meas['cuda_max_reserved'])}, allocator retries "
            f"{meas['cuda_alloc_retries']}"
        )
    print(f"schedc: memory per rank: {text}", file=sys.stderr, flush=True)
