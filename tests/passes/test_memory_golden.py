"""The memory ledger's predictions, byte for byte, as golden files: every bundled schedule,
as written and under each numerics and activation setting that changes a buffer (bf16
compute, gather, reduce; the upcast of no_sync; recompute; the chunked loss), for every
distinct plan of its ranks. A change to how lifetimes are derived shows here as a diff,
whatever `check`'s rounded summary shows (`SCHEDC_REGEN=1` accepts one)."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from schedc.compiler import compile_text
from schedc.ir.spec import Strategy
from schedc.lang.diagnostics import CompileError
from schedc.lang.resources import bundled_schedules
from schedc.passes.memory import predict
from tests.goldens import GOLDEN, assert_golden

SCHEDULES = bundled_schedules()

VARIANTS = {  # name -> the lines that replace the file's precision (appended at the end)
    "as written": "",
    "bf16 compute": "precision { compute = bf16 }",
    "bf16 gather": "precision { compute = bf16  gather = bf16  reduce = fp32 }",
    "bf16 reduce": "precision { reduce = bf16 }",
    "bf16 gather and reduce": "precision { compute = bf16  gather = bf16  reduce = bf16 }",
    "recompute": "recompute {blocks}",
    "loss chunk": "loss chunk 64",
    "bf16 loss chunk": "precision { compute = bf16 }\nloss chunk 64",
    "bf16 gather loss chunk": "precision { compute = bf16  gather = bf16 }\nloss chunk 64",
}


def variant(text: str, extra: str, n_layer: int) -> str:
    if extra.startswith("precision"):  # the variant's own policy, alone
        text = re.sub(r"(?m)^precision\s*(\{[^}]*\}|\S+)", "", text)
    text = re.sub(r"(?m)^memory\s+.*$", "", text)  # a budget is not what is compared
    blocks = f"h.0 .. h.{n_layer - 1}" if n_layer > 1 else "h.0"
    return text + "\n" + extra.replace("{blocks}", blocks) + "\n"


def report(text: str, name: str) -> str:
    try:
        c = compile_text(text, name)
    except CompileError as e:  # a setting the schedule's shape refuses: said, not skipped
        return "refused: " + ", ".join(sorted({d.code for d in e.diagnostics})) + "\n"
    out = []
    plans = {}
    for rank in range(c.spec.world):
        plans.setdefault(tuple(map(str, c.plan(rank).instrs)), []).append(rank)
    for ranks in plans.values():
        m = predict(c.spec, c.plan(ranks[0]))
        who = "every rank" if len(plans) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"
        vals = ", ".join(
            f"{f.name}={getattr(m, f.name)!r}" for f in fields(m) if f.name not in ("parts",)
        )
        out.append(f"{who}: {vals}")
        out.append("  parts: " + ", ".join(f"{n} {v}" for n, v in m.parts))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("path", SCHEDULES, ids=[p.stem for p in SCHEDULES])
def test_the_ledger_predicts_the_same_bytes(path):
    base = path.read_text()
    c = compile_text(base, path.name)
    lines = []
    for name, extra in VARIANTS.items():
        if "gather" in name and c.spec.kind is not Strategy.FSDP:
            continue  # DDP and one process gather nothing
        lines.append(f"## {name}")
        lines.append(report(variant(base, extra, c.spec.model.n_layer), path.name).rstrip("\n"))
    assert_golden(GOLDEN / "memory" / f"{path.stem}.txt", "\n".join(lines) + "\n")
