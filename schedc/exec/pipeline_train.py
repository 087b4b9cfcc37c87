"""`schedc run` of a pipeline schedule: each torchrun rank runs its stages' proven program.

    torchrun --standalone --nproc_per_node=2 -m schedc run \
        schedules/pipeline/tiny_pp2_interleaved.sched

The compiler generated, proved and timed every pipeline rank's program
(passes/pipeline_plan.py); here each rank builds its stages (exec/pipeline.py) and runs that
program step after step (with world = degree x dp, global rank r runs pipeline rank r // dp's
program on replica r % dp's slice of the batch, its stages' gradients all-reduced over dp,
or reduce-scattered into each replica's shard under the file's fsdp block), in the file's
precision policy (bf16 autocast, gather and reduce dtypes), logging each step as a DP run
does. Before step 1 the ranks agree as a DP run's do: the schedule's meaning, the programs
(in place of a plan's collectives), the data and the run flags.

What a DP run does besides its steps, a pipeline run does with the DP run's own code: its
`eval` block (exec/pipeline_eval.py), --log-json and --tensorboard, --nonfinite skip, --init
hf:DIR (each rank's stages from a Hugging Face GPT-2's weights) and --save / --resume
(`Saved`). With --trace each rank times its items (exec/pipeline.py `timed`) and rank 0
writes them (analysis/pipeline_trace.py). What it does not do yet is refused by the CLI
before torch is imported (cli/run.py `PIPELINE_NOT_YET`): probes, CUDA, `compile`, `loss
chunk`, checkpoints of HSDP per stage.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from schedc.analysis.pipeline_trace import trace_file
from schedc.compiler import Compiled
from schedc.exec.evaluate import Evaluations
from schedc.exec.failures import join, phase
from schedc.exec.heap import HeapPeak
from schedc.exec.options import TORCH_DTYPES, Comm, RunOptions
from schedc.exec.pipeline import PipelineExecutor
from schedc.exec.pipeline_comm import make_comm
from schedc.exec.pipeline_eval import Evaluated
from schedc.exec.pipeline_model import PipeJob
from schedc.exec.report import (
    Records,
    RunClock,
    eval_line,
    log,
    log_record,
    peak_memory,
    start_line,
    step_line,
)
from schedc.exec.train import (
    TrainOptions,
    agree,
    check_job,
    guarded,
    read_init,
    set_up_host,
)
from schedc.exec.update import judge_nonfinite
from schedc.ir.spec import Dtype
from schedc.passes.memory import fmt_bytes
from schedc.passes.pipeline_plan import PipelinePlan


class _Programs:
    """What the start-up agreement compares of a pipeline in place of a DP plan's collective
    order: every rank's program, as text."""

    def __init__(self, plan: PipelinePlan):
        self.text = "\n".join(plan.rank_lines())

    def collective_digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def run_pipeline(compiled: Compiled, opts: RunOptions, job: TrainOptions) -> int:
    """Train a pipeline schedule for its steps under torchrun, on CPU ranks (gloo)."""
    plan = compiled.pipeline
    assert plan is not None, "run_pipeline runs pipeline schedules"
    device = torch.device("cpu")
    check_job(compiled, job, device)
    threads = set_up_host(compiled, device)  # the threads, and the heap kept (exec/heap.py)
    comm, beats = join("gloo", opts.timeout_s)

    def run() -> None:
        ex, evals = _start(compiled, plan, comm, opts, job, device)
        saved = Saved(compiled, ex, comm) if job.save or job.resume else None
        if job.resume:
            assert saved is not None
            _resume(saved, job, comm)
        log(comm, start_line(compiled, device, threads))
        _steps(compiled, ex, comm, opts, job, device, saved, evals)
        if job.trace:
            _write_trace(job.trace, compiled, ex, comm)

    return guarded(compiled, comm, beats, run)


def _start(
    compiled: Compiled, plan: PipelinePlan, comm: Comm, opts: RunOptions, job: TrainOptions,
    device: torch.device,
) -> tuple[PipelineExecutor, Evaluations]:  # fmt: skip
    """The data read, the ranks agreed (on the run flags too, as a DP run's), step 0's
    weights read (the seed's, or --init's), this rank's stages built, and what its `eval`
    measures between steps (exec/pipeline_eval.py)."""
    spec = compiled.spec
    batches, val, hellaswag = agree(compiled, comm, opts, job, device, _Programs(plan))
    weights = None
    if job.init:
        phase.where = f"loading --init hf:{job.init}"
        weights = read_init(Path(job.init), spec)
        log(comm, f"schedc: weights of step 0 from hf:{job.init}")
    pipe = plan.pipeline
    stages = compiled.spec.pipeline.stages if compiled.spec.pipeline else ()
    # every rank makes every group; under HSDP per stage, the mesh's of the dp replicas
    pipe_comm = make_comm(comm.rank, spec.world, pipe, spec.declared_mesh)
    pj = PipeJob(
        spec.model,
        tuple(s.layers for s in stages),
        batches,
        spec.optim,
        spec.steps,
        spec.seed,
        **precision(spec),
        weights=weights,
    )
    # the plan the proof read, bound to this rank (once): its collectives and operands run
    bound = compiled.bound(comm.rank)
    ex = PipelineExecutor(pj, pipe, pipe_comm, bound, timed=bool(job.trace))
    return ex, Evaluations(Evaluated(compiled, ex, comm, opts), val, hellaswag)


class Saved:
    """A pipeline rank as the checkpoint store (exec/checkpoint/) reads a run.

    DDP per stage (or one replica): its stages' parameters by name and their AdamW state, the
    one form a DDP or one-process run saves, so a checkpoint moves between pipeline and
    data-parallel layouts (every parameter is some rank's; replicas and the tied copies hold
    it alike, and DCP writes it once). FSDP per stage: its units' flat shards and moments,
    as a DP FSDP run saves its units, each a DTensor on its stage's shard group (the tied
    unit's copies on the first and last stage are one layout, written once); such a
    checkpoint resumes the same pipeline's units (made once a run: making the groups is
    collective)."""

    def __init__(self, compiled: Compiled, ex: PipelineExecutor, comm: Comm):
        self.compiled, self.spec, self.comm = compiled, compiled.spec, comm
        self.ex, self.batches, self.params = ex, ex.job.batches, dict(ex.named)
        self.units = {u.name: u for u in getattr(ex.sync, "units", ())}
        self.optimizer, self.device = ex.optimizer, torch.device("cpu")
        if self.units:
            self.checkpoint_mesh = _stage_mesh(ex, comm)
            model, ps = compiled.spec.model, compiled.spec.pipeline
            assert ps is not None
            # every stage's units, in their flat order (meta.json names each parameter once)
            self.schedule_units = {u.name: list(model.flat_order(u.params)) for u in ps.units}

    @property
    def step_index(self) -> int:
        return self.ex.step_index

    @step_index.setter
    def step_index(self, step: int) -> None:
        self.ex.step_index = step


def _write_trace(path: str, compiled: Compiled, ex: PipelineExecutor, comm: Comm) -> None:
    """Every rank's item spans, gathered by rank 0 into one trace (analysis/pipeline_trace.py;
    `schedc render --trace` draws it beside the prediction)."""
    phase.where = "writing the trace"
    spans = [s for part in comm.gather(ex.spans or []) for s in part]
    if comm.rank == 0:
        plan = compiled.pipeline
        assert plan is not None
        data = trace_file(spans, compiled.source.path, plan.programs, compiled.spec.dp)
        with open(path, "w") as f:
            json.dump(data, f)
        print(f"schedc: trace written to {path} ({len(spans)} item spans)", flush=True)


def precision(spec) -> dict:
    """PipeJob's dtypes from the schedule: compute (autocast), gather (FSDP per stage's
    units' only) and reduce; None where it is the run's own fp32."""
    pipe, n = spec.pipeline, spec.numerics

    def low(d: Dtype) -> torch.dtype | None:
        return None if d is Dtype.FP32 else TORCH_DTYPES[d]

    return {
        "compute": low(n.compute),
        "gather": low(n.gather) if pipe and pipe.units else None,
        "reduce": low(n.reduce),
    }


def _steps(
    compiled: Compiled, ex: PipelineExecutor, comm: Comm, opts: RunOptions, job: TrainOptions,
    device, saved: Saved | None, evals: Evaluations,
) -> None:  # fmt: skip
    """The steps, each logged (and recorded with --log-json and --tensorboard on rank 0; a
    non-finite one stops the run or, with --nonfinite skip, is skipped: exec/update.py), then
    the memory report and the summary."""
    spec, first = compiled.spec, ex.step_index
    clock = RunClock(first, spec.steps)
    records = Records(comm.rank, job.log_json, job.tensorboard)
    peak = 0  # the live heap's peak over the steps after the first (which makes AdamW's m, v)
    try:
        for s in range(first, spec.steps):
            phase.where = f"step {s}"
            if s == first:
                st = ex.step()
            else:
                held = held_bytes(ex)
                with HeapPeak() as heap:
                    st = ex.step()
                peak = max(peak, held + heap.grew)
            judge_nonfinite(st, ex.losses, comm, opts.nonfinite)
            log(comm, step_line(st, spec, device, clock.done(st)))
            records.write(log_record(st))
            for rec in evals.after(st.step):  # validation, HellaSwag, samples: each due
                log(comm, eval_line(rec, spec.steps, spec.evaluation.val_batches))
                records.write(rec)
                clock.evaluated(rec)
            records.flush()
            if job.save and (ex.step_index % job.save_every == 0 or s + 1 == spec.steps):
                assert saved is not None
                _save(saved, job, comm)
    finally:
        records.close()
    report_pipeline_memory(compiled, comm, peak)
    log(comm, clock.summary(peak_memory(device)))


def _stage_mesh(ex: PipelineExecutor, comm: Comm):
    """The device mesh of this rank's stage's shard group (its dp replicas)."""
    from torch.distributed.device_mesh import DeviceMesh

    group = ex.comm.dp
    if group is None:  # one replica: a group of this rank alone, every rank making each
        dp = comm.world // ex.pipe.pp
        groups = [dist.new_group([p * dp]) for p in range(ex.pipe.pp)]
        group = groups[ex.comm.rank]
    return DeviceMesh.from_group(group, "cpu")


def _resume(saved: Saved, job: TrainOptions, comm: Comm) -> None:
    from schedc.exec.checkpoint import store  # DCP: a second to import, so only here
    from schedc.exec.checkpoint.files import find

    assert job.resume is not None
    phase.where = f"loading {job.resume}"
    step = store.load(saved, job.resume, key=job.key)
    log(comm, f"schedc: resumed from {find(job.resume)} at step {step}")


def _save(saved: Saved, job: TrainOptions, comm: Comm) -> None:
    from schedc.exec.checkpoint import store  # DCP: a second to import, so only here

    phase.where = f"saving step {saved.step_index}"
    path = store.save(saved, job.save, keep=job.keep, key=job.key)  # type: ignore[arg-type]
    log(comm, f"schedc: checkpoint {path}")


def held_bytes(ex: PipelineExecutor) -> int:
    """What a rank holds between steps, as the ledger's states count it: its stages'
    parameters (or FSDP shards and the copies they are gathered into), their gradients and
    AdamW's moments, each storage once."""
    tensors = [p for _, p in ex.named] + [p.grad for _, p in ex.named if p.grad is not None]
    for state in ex.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def report_pipeline_memory(compiled: Compiled, comm: Comm, measured: int) -> None:
    """Each rank's predicted peak (the pipeline ledger's, passes/pipeline_memory.py) beside the
    live heap's measured over the steps after the first, on rank 0 for every rank: pipeline
    ranks hold different stages. A run of one step measures nothing and says so."""
    plan = compiled.pipeline
    assert plan is not None
    every = comm.gather(measured)
    if comm.rank != 0:
        return
    dp = compiled.spec.dp
    pred = [plan.memory[r // dp].peak for r in range(comm.world)]  # pp-outermost ranks
    if not any(every):
        text = ", ".join(f"rank {r} {fmt_bytes(p)}" for r, p in enumerate(pred))
        print(
            f"schedc: memory (peak of states, buffers, activations): {text} predicted; one "
            "step ran, so nothing was measured (the first makes AdamW's moments)",
            file=sys.stderr,
            flush=True,
        )
        return
    text = "; ".join(
        f"rank {r} {fmt_bytes(p)} predicted, {fmt_bytes(m)} measured"
        for r, (p, m) in enumerate(zip(pred, every))
    )
    print(
        f"schedc: memory (peak of states, buffers, activations): {text} (live heap)",
        file=sys.stderr,
        flush=True,
    )
