"""The op vocabulary: every op has one text form, and that text parses back to the op."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedc.ir.op import (
    COLLECTIVES,
    DEFAULT_COMM,
    PLAN_KINDS,
    REDUCTIONS,
    STAGE_KINDS,
    STEP,
    Kind,
    Op,
    OpSyntaxError,
    Phase,
    bwd,
    fwd,
    recompute,
    stage_op,
)

LAYERS = st.sampled_from(["embed", "head"]) | st.integers(0, 200).map(lambda i: f"h.{i}")
GROUPS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)  # bucket/unit names
MBS = st.integers(0, 10**12)


@st.composite
def ops(draw) -> Op:
    kind = draw(st.sampled_from(list(Kind)))
    if kind is Kind.STEP:
        return STEP
    if kind.on_stage:
        comm = draw(st.sampled_from([DEFAULT_COMM, "c1", "up.0"])) if kind.is_p2p else DEFAULT_COMM
        return stage_op(kind, draw(st.integers(0, 10**6)), draw(MBS), comm)
    target = draw(LAYERS if kind in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE) else GROUPS)
    phase = draw(st.sampled_from(list(Phase))) if kind in (Kind.ALLGATHER, Kind.FREE) else None
    return Op(kind, target, draw(MBS), phase)


@given(ops())
def test_text_parses_back_to_the_op(op):
    assert Op.parse(str(op)) == op
    assert Op.parse(f"  {op}\n") == op  # surrounding whitespace is not part of an op
    assert repr(op) == f"Op({str(op)!r})"


@given(ops(), ops())
def test_equal_text_means_equal_ops(a, b):
    assert (str(a) == str(b)) == (a == b)  # the text is a faithful node key


@pytest.mark.parametrize(
    "text, op",
    [
        ("fwd[h.3]@mb1", fwd("h.3", 1)),
        ("bwd[embed]@mb0", bwd("embed", 0)),
        ("recompute[h.3]@mb1", recompute("h.3", 1)),
        ("allreduce[b1]@mb3", Op(Kind.ALLREDUCE, "b1", 3)),
        ("allgather[u2]@mb0:fwd", Op(Kind.ALLGATHER, "u2", 0, Phase.FWD)),
        ("free[u2]@mb0:bwd", Op(Kind.FREE, "u2", 0, Phase.BWD)),
        ("reducescatter[u2]@mb1", Op(Kind.REDUCESCATTER, "u2", 1)),
        ("optimizer.step", STEP),
        ("F[s1]@mb0", stage_op(Kind.F, 1, 0)),
        ("W[s0]@mb7", stage_op(Kind.W, 0, 7)),
        ("SEND_F[s0]@mb0", stage_op(Kind.SEND_F, 0, 0)),
        ("RECV_B[s2]@mb3:c1", stage_op(Kind.RECV_B, 2, 3, "c1")),
    ],
)
def test_the_documented_forms(text, op):
    assert Op.parse(text) == op and str(op) == text


def test_kinds_and_streams():
    assert COLLECTIVES == {Kind.ALLREDUCE, Kind.ALLGATHER, Kind.REDUCESCATTER}
    assert REDUCTIONS == {Kind.ALLREDUCE, Kind.REDUCESCATTER}
    assert [k for k in Kind if k.is_compute] == [
        Kind.FWD,
        Kind.BWD,
        Kind.RECOMPUTE,
        Kind.FREE,
        Kind.STEP,
        Kind.F,
        Kind.B,
        Kind.I,
        Kind.W,
    ]
    assert {k for k in Kind if k.is_p2p} == STAGE_KINDS - {Kind.F, Kind.B, Kind.I, Kind.W}
    assert set(PLAN_KINDS) | STAGE_KINDS == set(Kind) and not set(PLAN_KINDS) & STAGE_KINDS
    assert Kind("allreduce") is Kind.ALLREDUCE and Kind.STEP == "optimizer.step"
    assert Op(Kind.ALLREDUCE, "b1", 0).is_collective and not fwd("h.0", 0).is_collective


@pytest.mark.parametrize(
    "text, says, suggests",
    [
        (
            "",
            "'' is not an op; ops read like bwd[h.3]@mb1, allgather[u2]@mb0:fwd or optimizer.step",
            None,
        ),
        ("bwd h.3", "'bwd h.3' is not an op", None),
        ("fwd[h.0]@mb", "'fwd[h.0]@mb' is not an op", None),
        ("fwd[h.0]@mbx", "is not an op", None),
        ("fwd[h.0]@mb-1", "is not an op", None),
        ("fwd[h 0]@mb0", "is not an op", None),
        ("optimizer.stpe", "is not an op", None),
        ("bwdd[h.3]@mb1", "unknown op kind 'bwdd'", "bwd"),
        ("allreduc[b1]@mb0", "unknown op kind 'allreduc'", "allreduce"),
        ("fwd[]@mb0", "'fwd[]@mb0' names no fwd target inside [...]", None),
        ("bwd[h.3]", "'bwd[h.3]' names no micro-step; write @mb0, @mb1, ...", None),
        (
            "allgather[u1]@mb0",
            "allgather needs a phase: 'allgather[u1]@mb0:fwd' or 'allgather[u1]@mb0:bwd'",
            None,
        ),
        ("free[u1]@mb2", "free needs a phase", None),
        ("allreduce[b1]@mb0:fwd", "allreduce takes no phase; drop ':fwd'", None),
        ("allgather[u1]@mb0:both", "phase 'both' is neither fwd nor bwd", None),
        ("fwd[h.0]@mb" + "9" * 5000, "micro-step number 999999999999... is too large", None),
    ],
)
def test_malformed_text_says_what_is_wrong(text, says, suggests):
    with pytest.raises(OpSyntaxError) as info:
        Op.parse(text)
    assert says in str(info.value)
    if suggests is None:
        assert info.value.suggest is None
    else:
        word, candidates = info.value.suggest
        assert suggests in candidates and word != suggests


@given(st.text(max_size=40))
def test_any_text_is_an_op_or_a_syntax_error(text):
    try:
        op = Op.parse(text)
    except OpSyntaxError as e:
        assert str(e)
    else:
        assert Op.parse(str(op)) == op
