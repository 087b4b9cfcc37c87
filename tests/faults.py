"""Deliberately wrong executors and broken workers: the suite must catch each one.

    skip-accum-scale          forget the 1/k of gradient accumulation
    reduce-first-micro-step   all-reduce right after micro-step 0's backward, not the last
    fail-at OP                OP raises (the failure must show the plan around it)
    die-at OP                 the last rank's process exits at OP (the pool must not hang)
    hang-at OP                the last rank sleeps forever at OP (the pool must time out)
    nan-grad stepN [skip]     a NaN in one gradient on the last rank at step N
    reduce-in-bf16            gradients reduced in bf16 though the schedule says fp32
    no-cast-back              a bf16 all-reduce's result never copied back into the fp32
                              bucket (the bucket keeps this rank's own gradient / D)
    drop-gather-wait          the compute stream's first wait for an all-gather removed
                              from the plan (the CUDA sanitizer must report it)
    sleep comm|compute        torch.cuda._sleep before every op of that stream (CUDA only:
                              a missing event shows as changed bits once one side is slow)
    skip-replicate-allreduce  HSDP: the all-reduce of each unit's gradient shard over the
                              replicate group never runs (each replica keeps its own)
    split-replicate-divisor   not a fault: HSDP's divisor split between the reduce-scatter
                              (the world / R) and the replicate all-reduce (R), a plan the
                              proof accepts and the executor must run as it says
    drop-keeps                every instruction's keeps dropped (nothing read across
                              streams is kept alive: a CUDA race the sanitizer cannot see)
    record-keeps              not a fault, an instrument: every keep_alive and all-reduce,
                              with the collective being launched, in ex.mem["keeps"]

Each is applied to a built Executor by `inject(ex, fault)`, on every rank of the job: the
fault's first word picks its function in FAULTS, which gets the words after it.

    mutation CLASS            not applied to an executor: the first variant of a plan-mutation
                              class (tests/plan_mutations.py) bound into the Compiled the
                              executor is built from (`mutated`), the proof bypassed: what
                              a wrong plan the proof refutes would do if it ran
    mutation perturb LABEL    likewise, one operand perturbed (tests/operand_perturbations.py)
"""

from __future__ import annotations

import dataclasses
import os
import time


def mutated(compiled, name: str):
    """`compiled` with every rank's bound plan replaced by a wrong plan (`variant`: a plan-
    mutation class's first variant, or `perturb LABEL`), as if a lowering had made it and
    no proof had looked."""
    from tests.operand_perturbations import variant

    bounds = [compiled.bound(r) for r in range(compiled.spec.world)]
    return dataclasses.replace(compiled, bounds=tuple(variant(compiled.spec, bounds, name)))


def inject(ex, fault: str) -> None:
    name, _, arg = fault.partition(" ")
    if name not in FAULTS or bool(arg) != (name in TAKES_ARG):
        raise ValueError(f"unknown fault {fault!r}")
    FAULTS[name](ex, arg)


def _skip_accum_scale(ex, _: str) -> None:
    ex.loss_scale = 1.0


def _skip_replicate_allreduce(ex, _: str) -> None:
    from schedc.ir.op import Kind
    from schedc.ir.plan import Action

    def replicate(i) -> bool:
        return i.kind is Action.RUN and i.op.kind is Kind.ALLREDUCE and bool(ex.units)

    kept = tuple(i for i in ex.plan.instrs if not replicate(i))
    ex.plan = dataclasses.replace(ex.plan, instrs=kept)


def _split_replicate_divisor(ex, _: str) -> None:
    ex.plan = dataclasses.replace(ex.plan, instrs=split_divisor(ex.plan.instrs, ex.spec.mesh))


def split_divisor(instrs, mesh) -> tuple:
    """HSDP's instructions with each reduce-scatter dividing by the world / R and each
    replicate all-reduce by R: the same mean, another plan."""
    from schedc.ir.op import Kind

    R = mesh.replicate
    out = []
    for i in instrs:
        if i.op is not None and i.op.kind is Kind.REDUCESCATTER:
            i = dataclasses.replace(i, divisor=i.divisor // R)
        elif i.op is not None and i.op.kind is Kind.ALLREDUCE:
            i = dataclasses.replace(i, divisor=R)
        out.append(i)
    return tuple(out)


def _reduce_first_micro_step(ex, _: str) -> None:
    from schedc.ir.op import Kind
    from schedc.ir.plan import Action

    instrs = list(ex.plan.instrs)
    moved = [i for i in instrs if i.kind is Action.RUN and i.op.kind is Kind.ALLREDUCE]
    if ex.spec.accum > 1 and moved:
        last_bwd0 = max(
            k
            for k, i in enumerate(instrs)
            if i.kind is Action.RUN and i.op.kind is Kind.BWD and i.op.mb == 0
        )
        rest = [i for i in instrs if i not in moved and i.kind is not Action.WAIT]
        at = rest.index(instrs[last_bwd0]) + 1
        ex.plan = dataclasses.replace(ex.plan, instrs=tuple(rest[:at] + moved + rest[at:]))


def _trip(how: str, op, last: bool) -> None:
    """What fail-at, die-at and hang-at do when their op is reached (die and hang on the
    last rank only)."""
    if how == "fail-at":
        raise RuntimeError(f"injected failure in {op}")
    if how == "die-at" and last:
        os._exit(17)
    if how == "hang-at" and last:
        while True:
            time.sleep(60)


def _at(how: str):
    """fail-at, die-at, hang-at OP: `_trip` when OP is reached."""

    def apply(ex, target: str) -> None:
        run_op, compute, last = ex.run_op, ex.compute, ex.comm.rank == ex.comm.world - 1

        def trip(op) -> None:
            if str(op) == target:
                _trip(how, op, last)

        def broken(stream, op, *rest):
            trip(op)
            run_op(stream, op, *rest)

        def broken_compute(seg):  # fused forward/backward runs do not go through run_op
            for op in seg.ops:
                trip(op)
            compute(seg)

        ex.run_op, ex.compute = broken, broken_compute

    return apply


def _nan_grad(ex, arg: str) -> None:
    """A NaN in one gradient on the last rank at step N; "skip" runs with --nonfinite skip."""
    from schedc.exec.options import NonFinite

    words = arg.split()
    at, compute = int(words[0].removeprefix("step")), ex.compute
    if "skip" in words:
        ex.opts.nonfinite = NonFinite.SKIP

    def poisoned(seg):
        compute(seg)
        if ex.step_index == at and ex.comm.rank == ex.comm.world - 1 and seg.kind.value == "bwd":
            next(iter(ex.params.values())).grad.view(-1)[0] = float("nan")

    ex.compute = poisoned


def _reduce_in_bf16(ex, _: str) -> None:
    import torch

    ex.strategy.reduce_dtype = torch.bfloat16


def _no_cast_back(ex, _: str) -> None:
    from schedc.ir.op import Kind

    collective = ex.backend.collective

    def uncast(stream, op, launch, done, *rest):  # the all-reduce's completion dropped
        collective(stream, op, launch, None if op.kind is Kind.ALLREDUCE else done, *rest)

    ex.backend.collective = uncast


def _drop_gather_wait(ex, _: str) -> None:
    from schedc.ir.op import COMPUTE, Kind
    from schedc.ir.plan import Action

    plan = ex.plan
    k = next(
        k
        for k, i in enumerate(plan.instrs)
        if i.kind is Action.WAIT
        and i.stream == COMPUTE
        and i.event in plan.producers
        and plan.producers[i.event].kind is Kind.ALLGATHER
    )
    ex.plan = dataclasses.replace(plan, instrs=plan.instrs[:k] + plan.instrs[k + 1 :])


def _sleep(ex, which: str) -> None:
    import torch

    cycles = 2_000_000  # about a millisecond: longer than any nano kernel
    backend = ex.backend
    compute, collective = backend.compute, backend.collective

    def nap(stream: str) -> None:
        if stream == which:
            with torch.cuda.stream(backend.streams[stream]):
                torch.cuda._sleep(cycles)

    def slow_compute(stream, op, fn):
        nap(stream)
        compute(stream, op, fn)

    def slow_collective(stream, op, launch, done, *rest):
        nap(stream)
        collective(stream, op, launch, done, *rest)

    backend.compute, backend.collective = slow_compute, slow_collective


def _drop_keeps(ex, _: str) -> None:
    instrs = tuple(dataclasses.replace(i, keeps=()) for i in ex.plan.instrs)
    ex.plan = dataclasses.replace(ex.plan, instrs=instrs)


def _record_keeps(ex, _: str) -> None:
    backend, log = ex.backend, ex.mem.setdefault("keeps", [])
    collective, keep_alive, all_reduce = (
        backend.collective,
        backend.keep_alive,
        backend.all_reduce,
    )
    launching: list[str] = []  # the collective whose launch is running (it may be deferred)

    def ptr(t) -> int:
        return t.untyped_storage().data_ptr()

    def logged_collective(stream, op, launch, done, *rest):
        def logged_launch(pg, launch=launch, op=op):
            launching.append(str(op))
            try:
                return launch(pg)
            finally:
                launching.pop()

        collective(stream, op, logged_launch, done, *rest)

    def logged_keep(t, stream):
        where = launching[-1] if launching else "optimizer.step"
        log.append(("keep", where, stream, ptr(t)))
        keep_alive(t, stream)

    def logged_all_reduce(t):
        log.append(("allreduce", launching[-1] if launching else "", "", ptr(t)))
        return all_reduce(t)

    backend.collective, backend.keep_alive = logged_collective, logged_keep
    backend.all_reduce = logged_all_reduce


FAULTS = {
    "skip-accum-scale": _skip_accum_scale,
    "reduce-first-micro-step": _reduce_first_micro_step,
    "fail-at": _at("fail-at"),
    "die-at": _at("die-at"),
    "hang-at": _at("hang-at"),
    "nan-grad": _nan_grad,
    "reduce-in-bf16": _reduce_in_bf16,
    "no-cast-back": _no_cast_back,
    "drop-gather-wait": _drop_gather_wait,
    "sleep": _sleep,
    "skip-replicate-allreduce": _skip_replicate_allreduce,
    "split-replicate-divisor": _split_replicate_divisor,
    "drop-keeps": _drop_keeps,
    "record-keeps": _record_keeps,
}
TAKES_ARG = {"fail-at", "die-at", "hang-at", "nan-grad", "sleep"}
