"""Which compute ops the executor runs as one call (schedc/exec/fuse.py), without torch."""

from __future__ import annotations

from schedc.compiler import compile_file, compile_text
from schedc.exec.fuse import Segment, fuse
from schedc.ir.op import Kind
from schedc.ir.plan import Action
from tests.goldens import REPO

SCHEDULES = REPO / "schedules"


def segments(name: str, enabled: bool = True) -> list[Segment]:
    c = compile_file(SCHEDULES / name)
    return [i for i in fuse(c.plan(), c.spec.model, enabled) if isinstance(i, Segment)]


def test_ddp_overlap_fuses_all_but_the_bucket_boundary_and_the_tied_head():
    segs = segments("ddp_overlap.sched")
    by_mb = {mb: [(s.kind, s.layers) for s in segs if s.mb == mb] for mb in range(4)}
    body = ("embed", "h.0", "h.1", "h.2", "h.3")
    for mb in range(3):  # no_sync micro-steps: only the head, which re-reads wte, stands apart
        assert by_mb[mb] == [
            (Kind.FWD, body),
            (Kind.FWD, ("head",)),
            (Kind.BWD, ("head",)),
            (Kind.BWD, body[::-1]),
        ]
    # the last micro-step records an event after bwd[h.2] for bucket b1: cut there, both ways
    assert by_mb[3] == [
        (Kind.FWD, ("embed", "h.0", "h.1")),
        (Kind.FWD, ("h.2", "h.3")),
        (Kind.FWD, ("head",)),
        (Kind.BWD, ("head",)),
        (Kind.BWD, ("h.3", "h.2")),
        (Kind.BWD, ("h.1", "h.0", "embed")),
    ]


def test_no_backward_segment_holds_both_readers_of_the_tied_wte():
    for f in SCHEDULES.glob("*.sched"):
        for s in segments(f.name):
            assert not {"embed", "head"} <= set(s.layers), (f.name, s)


def test_fusion_keeps_every_op_once_and_in_plan_order():
    for f in SCHEDULES.glob("*.sched"):
        c = compile_file(f)
        plan = c.plan()
        items = fuse(plan, c.spec.model)
        ops = []
        for it in items:
            ops += (
                list(it.ops)
                if isinstance(it, Segment)
                else ([plan.instrs[it].op] if plan.instrs[it].kind is Action.RUN else [])
            )
        assert ops == plan.ops, f.name


def test_fsdp_cuts_at_every_unit_boundary():
    for s in segments("tiny_fsdp_prefetch.sched"):
        assert s.layers in {
            ("embed", "h.0"),
            ("h.1", "h.2"),
            ("h.3",),
            ("head",),
            ("h.0", "embed"),
            ("h.2", "h.1"),
        }, s


def test_disabled_fusion_runs_every_op_alone():
    assert all(len(s.layers) == 1 for s in segments("ddp_overlap.sched", enabled=False))


def test_a_recomputing_layer_runs_its_forward_alone_and_cuts_its_backward():
    """h.1 recomputes: its forward (without autograd) is a segment of its own, the recompute
    op stands between bwd[h.2] and bwd[h.1], and backward pieces end at h.1's input."""
    text = (SCHEDULES / "tiny_1gpu.sched").read_text() + "\nrecompute h.1\n"
    c = compile_text(text)
    items = fuse(c.plan(), c.spec.model)
    segs = [(s.kind, s.layers) for s in items if isinstance(s, Segment) and s.mb == 0]
    assert segs == [
        (Kind.FWD, ("embed", "h.0")),
        (Kind.FWD, ("h.1",)),
        (Kind.FWD, ("h.2", "h.3")),
        (Kind.FWD, ("head",)),
        (Kind.BWD, ("head",)),
        (Kind.BWD, ("h.3", "h.2")),
        (Kind.BWD, ("h.1",)),
        (Kind.BWD, ("h.0", "embed")),
    ]
    plan = c.plan()
    alone = [plan.instrs[i].op for i in items if not isinstance(i, Segment)]
    assert [str(op) for op in alone if op is not None and op.kind is Kind.RECOMPUTE][:1] == [
        "recompute[h.1]@mb0"
    ]
