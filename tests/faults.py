"""Deliberately wrong executor variants: the suite must catch each one."""

from __future__ import annotations


def inject(ex, fault: str) -> None:
    if fault == "skip-accum-scale":
        # forget the 1/k of gradient accumulation
        ex.loss_scale = 1.0
    elif fault == "reduce-first-micro-step":
        # all-reduce after the first micro-step's backward instead of the last one's
        import dataclasses

        from schedc.ir import Kind

        instrs = list(ex.plan.instrs)
        moved = [i for i in instrs if i.kind == "run" and i.op.kind is Kind.ALLREDUCE]
        if ex.spec.accum > 1 and moved:
            last_bwd0 = max(k for k, i in enumerate(instrs) if i.kind == "run"
                            and i.op.kind is Kind.BWD and i.op.mb == 0)
            rest = [i for i in instrs if i not in moved and i.kind != "wait"]
            at = rest.index(instrs[last_bwd0]) + 1
            ex.plan = dataclasses.replace(ex.plan, instrs=tuple(rest[:at] + moved + rest[at:]))
    elif fault.startswith("fail-at "):
        # an instruction that raises: the executor must show the plan around it
        target, run_op = fault.split(" ", 1)[1], ex.run_op

        def failing(stream, op):
            if str(op) == target:
                raise RuntimeError(f"injected failure in {op}")
            run_op(stream, op)

        ex.run_op = failing
    else:
        raise ValueError(f"unknown fault {fault!r}")
