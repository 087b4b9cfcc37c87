"""`schedc run`: train a compiled schedule under torchrun, and end cleanly when anything fails.

    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp_overlap.sched \
        --save ckpt --save-every 10 --timeout 60
    torchrun ... -m schedc run schedules/tiny_ddp_overlap.sched --resume ckpt

Before step 1 every rank proves it runs the same thing as the others: the same schedule
meaning (not text), the same collective order, the same data, the same resume checkpoint
and step, save settings and run flags. During the run, a rank that fails names where it
was and which ranks said nothing, and torchrun ends the job (exec/failures.py). Non-finite
losses or gradient norms stop the run with the step and micro-step named (or, with
`--nonfinite skip`, skip that update and say so). Checkpoints (exec/checkpoint/) are
complete or absent. What the run prints is exec/report.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from schedc.compiler import Compiled
from schedc.errors import RunError, UserError
from schedc.exec.backends import nccl_launch_order
from schedc.exec.evaluate import Evaluations
from schedc.exec.executor import Executor, PlanError, collective_streams
from schedc.exec.failures import fail, join, phase, watch_sigterm
from schedc.exec.heap import keep_freed_memory
from schedc.exec.heartbeat import Heartbeat
from schedc.exec.options import Comm, RunOptions, auto_note, local_world, pick_device
from schedc.exec.report import (
    Records,
    RunClock,
    eval_line,
    log,
    log_record,
    mfu,
    peak_memory,
    report_memory,
    start_line,
    step_line,
    write_trace,
)
from schedc.ir.spec import Spec
from schedc.model.data import CORPUS, DataError, GlobalBatches, load_batches

if TYPE_CHECKING:
    from schedc.model.hellaswag import Example


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
    tensorboard: str | None = None  # a directory rank 0 writes TensorBoard scalars into
    key: bytes | None = None  # --checkpoint-key: save signs meta.json, resume checks it
    init: str | None = None  # --init hf:DIR: the directory of step 0's weights (exec/hf.py)


class Collectives(Protocol):
    """What agreement compares of a rank's communication: a DP plan's collective order, or a
    pipeline's programs (exec/pipeline_train.py)."""

    def collective_digest(self) -> str: ...


def agree_at_startup(
    compiled: Compiled,
    comm: Comm,
    plan: Collectives,
    data: str,
    flags: dict[str, str] | None = None,
) -> None:
    """Every rank runs the same thing, or none starts: the plans rank 0 proved (their
    digest: the other ranks bind their own plan without proving every rank's), the
    schedule's meaning (agree.meaning:
    model, batch, steps, seed after flags, resolved data source, optimizer, strategy; not its
    text, so comments and spelling may differ), the same collectives in the same order, the
    same data (a fingerprint of the tokens read), and the same run flags (`flags`: resume
    source and step, save settings, --nonfinite, --probe, --trace, device, master dtype).
    The meaning covers every field of the resolved schedule, so the numerics, recompute and
    the mesh after --precision, --tf32 and --compile are compared too. A difference is named
    by field and rank on every rank: `seed 1 on rank 0, 2 on rank 1`."""
    from schedc.passes.agree import meaning

    mine: dict[str, Any] = {
        "rank": comm.rank,
        "path": compiled.source.path,
        "fields": {
            **meaning(compiled.spec),
            "plans": compiled.plans_digest,  # what rank 0's proof covered (cli/run.py)
            "collectives": plan.collective_digest(),
            "data": data,
            **(flags or {}),
        },
    }
    said = json.dumps(mine["fields"], sort_keys=True, default=str)
    if len(set(comm.gather(hashlib.sha256(said.encode()).hexdigest()))) == 1:
        return  # one digest a rank: 64 bytes each, not every rank's fields to every rank
    everyone = comm.gather(mine)  # someone differs: every rank's fields, to name it
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
    would otherwise wait in DCP's collectives for the others until --timeout), the weights
    --init names (the directory and a hash of its files), the save directory and cadence,
    what to do on a non-finite loss, the device type, the precision."""
    from schedc.exec.checkpoint.files import find
    from schedc.exec.checkpoint.layout import CheckpointError
    from schedc.exec.checkpoint.meta_json import read_meta

    resume = "none"
    if job.resume:
        try:
            # bounded, a regular file only, its HMAC checked first with --checkpoint-key
            path = find(job.resume)
            step = read_meta(path, job.key)["step"]
            resume = f"{path.resolve()} (step {step})"
        except (CheckpointError, OSError) as e:
            resume = f"unusable: {e}"  # said after agreement, by every rank that has it
    init = "none"
    if job.init:
        from schedc.exec.hf import source

        try:
            init = source(Path(job.init))
        except (UserError, OSError) as e:
            init = f"unusable: {e}"  # said after agreement, as --resume's
    save = "none"
    if job.save:
        save = f"{os.path.abspath(job.save)} every {job.save_every}, keep {job.keep}"
    return {
        "--resume": resume,
        "--init": init,
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
    device = pick_device(opts.device)
    check_job(compiled, job, device)
    threads = set_up_host(compiled, device)
    comm, beats = join("nccl" if device.type == "cuda" else "gloo", opts.timeout_s)

    def run() -> None:
        batches, val, hellaswag = agree(compiled, comm, opts, job, device)
        ex = start_executor(compiled, comm, opts, job, batches)
        log(comm, start_line(compiled, device, threads))
        if note := auto_note(opts.device, device):
            log(comm, f"schedc: {note}")
        if note := batches.fold_note():
            log(comm, f"schedc: data: {note}")
        clock = run_steps(ex, comm, job, device, Evaluations(ex, val, hellaswag))
        finish(compiled, ex, opts, job, device, clock)

    return guarded(compiled, comm, beats, run)


def guarded(compiled: Compiled, comm: Comm, beats: Heartbeat, run: Callable[[], None]) -> int:
    """`run` (start-up and steps) under the protocol every run of a rank shares: SIGTERM
    watched, `join`'s heartbeat beating; a user error said in one line (and, in a larger job,
    to every rank, so no rank waits on it), any other failure reported with the phase it
    happened in; then the executor and the process groups let go while the interpreter is
    whole."""
    from schedc.exec.checkpoint.layout import CheckpointError

    phase.where, phase.ex = "start-up", None
    watch_sigterm(comm)
    try:
        run()
    except (CheckpointError, RunError) as e:
        world = compiled.spec.world  # the job's, as check_job found
        if isinstance(e, PlanError) or (world > 1 and not isinstance(e, CheckpointError)):
            fail(comm, str(e), phase.where, getattr(e, "cause", None))
        let_go(beats)
        raise  # a user error: the CLI prints it in one line, exit 1
    except Exception as e:  # a collective that timed out or lost its peer, mostly
        fail(comm, f"{type(e).__name__}: {e}", phase.where)
    let_go(beats)
    return 0


def let_go(beats: Heartbeat) -> None:
    """The heartbeat stopped and the process groups destroyed while the interpreter is whole,
    on a user error's way out too: left to the interpreter's teardown, a beating thread inside
    a store call or gloo's threads met the C++ destructors, and the rank aborted now and then
    (SIGABRT, 'terminate called without an active exception', after its one-line error)."""
    beats.done()
    phase.ex = None  # the executor's process groups go now, not in the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()


def check_job(compiled: Compiled, job: TrainOptions, device: torch.device) -> None:
    """Refuse what this job cannot run before it starts: more ranks than this node has GPUs,
    a job of another world size than the schedule's. On CUDA, this rank's GPU becomes the
    current device."""
    spec = compiled.spec
    if device.type == "cuda":
        check_gpus(local_world(), torch.cuda.device_count())
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # timeouts end the job
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != spec.world:
        raise RunError(
            f"{compiled.source.path} is a world-{spec.world} schedule, but this job "
            f"has {world_env} rank{'s' if world_env != 1 else ''}; on one node `schedc run "
            f"{compiled.source.path}` starts its {spec.world} ranks itself; across nodes, "
            f"torchrun's nnodes x nproc_per_node must make {spec.world}"
        )


def set_up_host(compiled: Compiled, device: torch.device) -> str:
    """What the process sets before the job's first communicator: on a CPU the threads and
    the heap, on CUDA NCCL's launch order. Returns the threads' note for the start line."""
    threads = ""
    if device.type == "cpu":
        threads = cpu_threads(local_world())
        keep_freed_memory()  # else page faults cost a fifth of a CPU step (exec/heap.py)
    if device.type == "cuda":  # before the first NCCL communicator exists
        nccl_launch_order(len(collective_streams(compiled.plan(int(os.environ.get("RANK", 0))))))
    return threads


def cpu_threads(local_world: int) -> str:
    """Set torch's intra-op threads on a CPU run, unless the user chose: OMP_NUM_THREADS
    (torch has read it already; torchrun sets 1 when it starts several ranks and nothing is
    set) is kept as it is. Otherwise 1 thread per rank when a node runs several (torchrun's
    own default, so that a job launched by hand gets the same), all cores at world 1.
    Returns where the count came from, for the start line."""
    if omp := os.environ.get("OMP_NUM_THREADS", "").strip():
        return f", OMP_NUM_THREADS={omp}"  # torch uses at most the cores it has
    cores = max(1, os.cpu_count() or 1)
    torch.set_num_threads(1 if local_world > 1 else cores)
    return busy_hint(torch.get_num_threads(), os.getloadavg()[0], cores)


def busy_hint(threads: int, load: float, cores: int) -> str:
    """Every core for one rank is right on an idle machine and wrong on a busy one: threads
    that wait for each other's slices ran 15x slower than one thread on a shared 2-core
    machine. Said on the start line when the 1-minute load already takes half the cores."""
    if threads < 2 or load < cores / 2:
        return ""
    return (
        f"; the machine is busy, load {load:.1f} on {cores} cores: OMP_NUM_THREADS=1 may run faster"
    )


def agree(
    compiled: Compiled,
    comm: Comm,
    opts: RunOptions,
    job: TrainOptions,
    device: torch.device,
    plan: Collectives | None = None,
) -> tuple[GlobalBatches, GlobalBatches | None, list[Example] | None]:
    """Read the data and agree with every rank before anything else communicates: building
    the executor creates a process group per stream, which would wait forever for a rank
    whose schedule has other streams. Returns the batches, the validation batches and the
    HellaSwag examples (None where not measured). `plan`: what is compared of the rank's
    communication (a pipeline's programs; else its plan's collectives)."""
    from schedc.exec.checkpoint.layout import CheckpointError

    spec = compiled.spec
    shape = (spec.seq_len, spec.seqs, spec.model.vocab_size)
    val = None
    try:
        batches = load_batches(spec.data, *shape)
        if spec.evaluation.val_every:
            val = load_batches(spec.data, *shape, split="val")
    except DataError as e:
        raise RunError(data_error(e, spec.data.source)) from None
    hellaswag, scored = read_hellaswag_file(spec)
    flags = run_flags(job, device, opts)
    data = batches.fingerprint() + (f", val {val.fingerprint()}" if val else "") + scored
    agree_at_startup(compiled, comm, plan or compiled.plan(comm.rank), data, flags)
    if flags["--resume"].startswith("unusable: "):  # the same on every rank: agreed
        raise CheckpointError(flags["--resume"].removeprefix("unusable: "))
    if flags["--init"].startswith("unusable: "):
        raise RunError(flags["--init"].removeprefix("unusable: "))
    return batches, val, hellaswag


def read_hellaswag_file(spec: Spec) -> tuple[list[Example] | None, str]:
    """The HellaSwag examples when they are scored, and what the ranks agree on of them (the
    file's size and hash: every rank must score its share of the same examples)."""
    if not spec.evaluation.hellaswag_on:
        return None, ""
    from schedc.model.hellaswag import read_hellaswag

    try:
        examples, seen = read_hellaswag(spec.evaluation.hellaswag or "", spec.model.block_size)
    except DataError as e:
        raise RunError(f"hellaswag: {e}") from None
    return examples, f", hellaswag {seen}"


def start_executor(
    compiled: Compiled, comm: Comm, opts: RunOptions, job: TrainOptions, batches: GlobalBatches
) -> Executor:
    """The executor, its collectives and layers probed with --probe, and its state loaded
    from the checkpoint --resume names or its weights from the directory --init names."""
    ex = phase.ex = Executor(compiled, comm, opts, batches)
    if opts.probe:
        phase.where = "probing collectives and layers for the trace"
        ex.probe()
    if job.init:
        phase.where = f"loading --init hf:{job.init}"
        init_weights(ex, Path(job.init))
        log(comm, f"schedc: weights of step 0 from hf:{job.init}")
    if job.resume:
        from schedc.exec.checkpoint import store  # DCP: a second to import, so only here
        from schedc.exec.checkpoint.files import find

        phase.where = f"loading {job.resume}"
        step = store.load(ex, job.resume, key=job.key)
        log(comm, f"schedc: resumed from {find(job.resume)} at step {step}")
    return ex


def init_weights(ex: Executor, directory: Path) -> None:
    """A Hugging Face GPT-2's weights in place of the seed's, on every rank, each keeping its
    shard (exec/hf.py; the ranks agreed on the files' hash)."""
    from schedc.exec.checkpoint.state import load_parameters

    load_parameters(ex, read_init(directory, ex.spec))


def read_init(directory: Path, spec: Spec) -> dict[str, torch.Tensor]:
    """--init hf:DIR's weights, by schedc's parameter names (exec/hf.py); a file that
    cannot be used is a RunError, said in one line."""
    from schedc.exec import hf

    try:
        return hf.load(directory, spec.model, spec.model_name)
    except UserError as e:
        raise RunError(str(e)) from None


def run_steps(
    ex: Executor, comm: Comm, job: TrainOptions, device: torch.device, evals: Evaluations
) -> RunClock:
    """The steps, each logged (and recorded with --log-json and --tensorboard); after each,
    the evaluations due (validation, HellaSwag, samples: exec/evaluate.py), logged and
    recorded too; a checkpoint every --save-every steps and after the last."""
    if job.save:
        from schedc.exec.checkpoint import store  # DCP: a second to import, so only here
    spec = ex.spec
    records = Records(comm.rank, job.log_json, job.tensorboard)
    clock = RunClock(ex.step_index, spec.steps)
    while ex.step_index < spec.steps:
        phase.where = f"step {ex.step_index}"
        st = ex.step()
        log(comm, step_line(st, spec, device, clock.done(st)))
        records.write(log_record(st, mfu(spec, st.tokens_per_s, device)))
        for rec in evals.after(st.step):  # each sets phase.where
            log(comm, eval_line(rec, spec.steps, spec.evaluation.val_batches))
            records.write(rec)
            clock.evaluated(rec)
        records.flush()
        if job.save and (ex.step_index % job.save_every == 0 or ex.step_index == spec.steps):
            phase.where = f"saving step {ex.step_index}"
            path = store.save(ex, job.save, keep=job.keep, key=job.key)
            log(comm, f"schedc: checkpoint {path}")
    records.close()
    return clock


def finish(
    compiled: Compiled,
    ex: Executor,
    opts: RunOptions,
    job: TrainOptions,
    device: torch.device,
    clock: RunClock,
) -> None:
    """The executor closed, the trace written, the memory report and the summary said."""
    ex.close()
    if job.trace:
        write_trace(job.trace, ex, ex.comm)
    if ex.comm.rank == 0 and opts.log:
        report_memory(compiled, ex)
    log(ex.comm, clock.summary(peak_memory(device)))
