"""AST -> Spec: names resolved, numbers checked, coverage proven, batch arithmetic done.

This pass judges everything a schedule declares (the graph pass judges what it does):
names exist, values are in range, every parameter is in exactly one bucket or unit, the
global batch is micro x accumulation x world exactly, the tied weight sits where both its
users can see it. All findings are collected before the stage fails.

`resolve` runs one small pass per idea (its body gives their order); each reads the
statements it judges from the shared Context (context.py) and reports there:

    model.py        the model: a named size, its overrides (a keyed table, keyed.py)
    settings.py     world, micro, accumulate, steps, seed, batch, memory, data, toggles
    optimizer.py    adamw's values (a keyed table)
    evaluation.py   `eval { ... }`: what a run measures besides training (a keyed table)
    batch.py        global batch = micro x accumulation x world; the step's size bounded
    strategy.py     ddp or fsdp: blocks.py, then ddp.py (buckets) or fsdp.py (units),
                    both through cover.py (groups, coverage) and refs.py (layer names)
    pipeline.py     `pipeline { ... }`: stages, degree, schedule; the batch over dp
    mesh.py         replicate x shard
    numerics.py     precision (a keyed table), tf32, compile
    activations.py  loss chunk, recompute
    programs.py     streams and written programs

Numbers with units and ranges are read by values.py, the same for a file and for a flag.
"""

from __future__ import annotations

from schedc.ir.spec import FSDPSpec, Spec
from schedc.lang.resolve.activations import chunk_loss, resolve_recompute
from schedc.lang.resolve.batch import MAX_OPS, bound_ops, ops_per_step, split_batch
from schedc.lang.resolve.context import Context, Overrides, flag_place
from schedc.lang.resolve.evaluation import resolve_evaluation
from schedc.lang.resolve.mesh import resolve_mesh
from schedc.lang.resolve.model import resolve_model
from schedc.lang.resolve.numerics import resolve_numerics
from schedc.lang.resolve.optimizer import resolve_optimizer
from schedc.lang.resolve.pipeline import pipeline_split
from schedc.lang.resolve.programs import Scope, resolve_programs, resolve_streams
from schedc.lang.resolve.settings import (
    DEFAULT_SEED,
    DEFAULT_STEPS,
    read_run,
    read_toggles,
    require,
)
from schedc.lang.resolve.strategy import resolve_strategy
from schedc.lang.resolve.values import LIMITS, MAX_SIZE, UNITS, range_error, size_bytes
from schedc.lang.syntax import Schedule

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_STEPS",
    "LIMITS",
    "MAX_OPS",
    "MAX_SIZE",
    "UNITS",
    "Overrides",
    "flag_place",
    "ops_per_step",
    "range_error",
    "resolve",
    "size_bytes",
]


def resolve(ast: Schedule, overrides: Overrides = Overrides()) -> tuple[Spec, list]:
    """The resolved schedule and its warnings; raises CompileError on any error.

    The order is the order findings are made in (and `Spec.where` lists the statements in).
    """
    cx = Context(ast, overrides)
    model_name, model = resolve_model(cx)
    run = read_run(cx)
    optim = resolve_optimizer(cx)
    evaluation = resolve_evaluation(cx, run.data, model)
    toggles = read_toggles(cx)
    pipeline, split, terms = pipeline_split(cx, model, run)  # the batch is split over dp
    require(cx, model_name, run)
    micro, accum = split_batch(cx, split, model, terms)
    # a pipeline's replicas all-reduce each stage's gradients (one bucket a stage, or its ddp
    # block's buckets) or shard them by its fsdp block, read with the stages: no DP strategy
    piped = pipeline is not None or "pipeline" in cx.seen
    strategy = None if piped else resolve_strategy(cx, model, split.world)
    mesh = resolve_mesh(cx, run.world, strategy, pipeline)  # a pipeline's: its stages' dp's
    hsdp = mesh is not None and mesh.replicate > 1
    # a sharded pipeline gathers its units: its precision may name a gather dtype
    gathers = FSDPSpec(()) if pipeline is not None and pipeline.units else strategy
    numerics = chunk_loss(cx, resolve_numerics(cx, gathers, toggles))
    recompute = resolve_recompute(cx, model, strategy)
    accum = bound_ops(cx, model, accum, strategy, recompute, hsdp)
    streams = resolve_streams(cx, strategy)
    programs = resolve_programs(cx, streams, Scope(model, strategy, run.world, accum, hsdp))
    cx.diag.raise_if_any()
    # no error, so every value a Spec needs was found: `require` reports a missing one, and
    # each reader a refused one
    assert model_name is not None and model is not None and micro is not None
    assert run.world is not None and run.seqs is not None and run.seq_len is not None
    assert accum is not None
    spec = Spec(
        source=cx.src,
        model_name=model_name,
        model=model,
        world=run.world,
        seqs=run.seqs,
        seq_len=run.seq_len,
        micro=micro,
        accum=accum,
        steps=run.steps,
        seed=run.seed,
        data=run.data,
        optim=optim,
        memory=run.memory,
        strategy=strategy,
        streams=streams,
        programs=programs,
        numerics=numerics,
        recompute=recompute,
        evaluation=evaluation,
        where=dict(cx.seen),
        declared_mesh=mesh,
        pipeline=pipeline,
    )
    return spec, cx.diag.warnings
