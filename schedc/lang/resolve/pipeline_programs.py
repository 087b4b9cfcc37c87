"""`program on rank N { ... }` in a pipeline block: a pipeline rank's program written out, in
place of a named schedule's, each item kept with its span.

    program on rank 0 { F[s0]@mb0 SEND_F[s0]@mb0 F[s0]@mb1 SEND_F[s0]@mb1+RECV_B[s0]@mb0 ... }

An item is one stage op in its IR text (schedc/ir/op.py), or transfers joined by `+`,
issued as one group (`batch_isend_irecv`). The stage in brackets is a stage of the block, by
name; the micro-batch is `@mbN`; a transfer may name a communicator (`:c1`; `pp` when not
written). What the text means is judged here (a kind that does not exist, a stage the block
does not declare, a compute action in a group, a rank without a program); whether the
programs run, pair and finish is the pipeline proofs' (passes/pipeline_plan.py), located at
the items this records.
"""

from __future__ import annotations

import re

from schedc.ir.op import DEFAULT_COMM, Kind, Op, stage_op
from schedc.ir.pipeline import Item
from schedc.ir.source import Span
from schedc.ir.spec import WrittenPrograms
from schedc.lang.diagnostics import Note, did_you_mean
from schedc.lang.nodes import OpText, PipeItem, PipeProgram
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.values import LIMITS, int_of

KINDS = [k.value for k in Kind if k.on_stage]
EXAMPLE = "F[s0]@mb0, SEND_F[s0]@mb0 or RECV_B[s0]@mb1:c1"
# the OP token has already matched NAME[...] and an optional @ with letters, digits, _ and :
_TEXT = re.compile(r"(?P<kind>[^\[]*)\[(?P<stage>[^\]]*)\](?P<rest>.*)", re.S)
_REST = re.compile(r"@mb(?P<mb>[0-9]+)(?::(?P<comm>[A-Za-z_][A-Za-z0-9_]*))?")
MAX_MB = LIMITS["accumulate"][1]  # no pipeline has more micro-batches than this


def resolve_written(
    cx: Context,
    programs: list[PipeProgram],
    stages: list[str],
    degree: int,
    head: Span,
) -> WrittenPrograms | None:
    """Every rank's program as written, or None after reporting what does not read."""
    errors = len(cx.diag.errors)
    out: dict[int, list[Item]] = {}
    items: dict[tuple[int, int], Span] = {}
    heads: dict[int, Span] = {}
    for p in programs:
        keyword = cx.src.span(p.span.start, p.span.start + len("program"))
        rank = int_of(cx.diag, p.rank, "a pipeline rank", 0, degree - 1)
        if rank is None or not cx.once(
            f"pipeline.program.{rank}", keyword, f"the program of pipeline rank {rank}"
        ):
            continue
        heads[rank] = keyword
        out[rank] = []
        for it in p.items:
            item = _item(cx, it, stages)
            if item is not None:
                items[(rank, len(out[rank]))] = it.span
                out[rank].append(item)
    if len(cx.diag.errors) > errors:
        return None
    for r in range(degree):
        if r not in heads:
            written = ", ".join(str(k) for k in sorted(heads))
            cx.err(
                "missing-setting",
                f"pipeline rank {r} has no program: the pipeline runs on {degree} ranks, "
                f"and every one runs its own",
                head,
                hint=f"write `program on rank {r} {{ ... }}` in the pipeline block",
                notes=tuple(
                    Note(f"programs are written for rank {written}", heads[k])
                    for k in sorted(heads)[:1]
                ),  # fmt: skip
            )
    if len(cx.diag.errors) > errors:
        return None
    return WrittenPrograms(out, items, heads)


def _item(cx: Context, it: PipeItem, stages: list[str]) -> Item | None:
    """One item: an action, or transfers issued together; None after reporting."""
    acts = [_action(cx, t, stages) for t in it.actions]
    if any(a is None for a in acts):
        return None
    item = tuple(a for a in acts if a is not None)
    if len(item) > 1:
        for a, t in zip(item, it.actions):
            if not a.kind.is_p2p:
                cx.err(
                    "syntax",
                    f"{t.text} is compute, in a group joined by '+': a group issues "
                    "sends and receives together (batch_isend_irecv)",
                    t.span,
                    hint=f"write {t.text} as an item of its own, before or after the group",
                )
                return None
    return item


def _action(cx: Context, tok: OpText, stages: list[str]) -> Op | None:
    """One action's text: its kind, its stage by name, its micro-batch and communicator."""
    text, span = tok.text, tok.span
    m = _TEXT.fullmatch(text)
    if m is None:  # the lexer's OP always has [...]; kept as a guard
        cx.err("syntax", f"'{text}' is not a pipeline action", span, hint=f"write {EXAMPLE}")
        return None
    kind_text, stage_text, rest = m.group("kind", "stage", "rest")
    if kind_text not in KINDS:
        hint = did_you_mean(kind_text, KINDS) or (
            "a pipeline program runs stages, not layers: its actions are "
            f"{', '.join(KINDS)}, e.g. {EXAMPLE}"
        )
        cx.err("syntax", f"unknown pipeline action '{kind_text}' in {text}", span, hint=hint)
        return None
    kind = Kind(kind_text)
    if stage_text not in stages:
        hint = (None if cx.diag.full else did_you_mean(stage_text, stages)) or (
            f"the stages are {', '.join(stages)}"
        )
        cx.err("unknown-name", f"unknown stage '{stage_text}' in {text}", span, hint=hint)
        return None
    r = _REST.fullmatch(rest)
    if r is None:
        cx.err(
            "syntax",
            f"{text} names no micro-batch as @mbN (and an optional :communicator)",
            span,
            hint=f"write {kind_text}[{stage_text}]@mb0, or e.g. {EXAMPLE}",
        )
        return None
    mb_text, comm = r.group("mb"), r.group("comm")
    if len(mb_text) > len(str(MAX_MB)) or int(mb_text) > MAX_MB:
        shown = mb_text if len(mb_text) <= 20 else f"{mb_text[:12]}..."
        cx.err(
            "value-range",
            f"micro-batch {shown} in {kind_text}[{stage_text}]@mb... is beyond any "
            f"pipeline's: microbatches is at most {MAX_MB:,}",
            span,
        )
        return None
    if comm is not None and not kind.is_p2p:
        cx.err(
            "syntax",
            f"{kind_text}[{stage_text}]@mb{mb_text} is compute and runs on no communicator",
            span,
            hint=f"drop ':{comm}'; a send or receive names its communicator",
        )
        return None
    return stage_op(kind, stages.index(stage_text), int(mb_text), comm or DEFAULT_COMM)
