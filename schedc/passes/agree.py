"""Do two schedules compute the same update? (seed 000: one GPU vs eight, one global batch)

Two schedules agree when they train the same model on the same data with the same
optimizer, and their step reads the same set of sequences, each exactly once, with the
same weight in the loss: per token 1/(B T) inside a micro-batch mean, x 1/k for
accumulation, x 1/D for averaging across ranks. The weights are computed exactly (as
fractions) from the very slices each (rank, micro-step) reads, not assumed.

Numerics are compared too, but do not decide agreement: two schedules that read the same
batch with the same weights compute the same update in exact arithmetic whatever they
round to, so `schedc check a b` still succeeds, and says which dtypes differ instead of
"the same update" (`Agreement.numerics`). A bf16 schedule is meant to be compared with its
fp32 twin: refusing would make that impossible, and the rounding it adds is what its
policy declares, not a mistake in the batch. What counts is the arithmetic each really
does (`Numerics.effective`): an unused gather dtype, or tf32 under bf16 autocast, is no
difference.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from schedc.ir.spec import DDPSpec, FSDPSpec, Spec
from schedc.lang.diagnostics import Diagnostic, Note, count
from schedc.model.batching import sequence_ids


@dataclass(frozen=True)
class Agreement:
    tokens: tuple[int, int]  # tokens per update of each schedule
    diagnostics: tuple[Diagnostic, ...]
    numerics: tuple[str, ...] = ()  # how the arithmetic differs: "compute fp32 vs bf16"

    @property
    def agree(self) -> bool:
        return not self.diagnostics


def sequence_weights(spec: Spec) -> dict[int, Fraction]:
    """Weight of each global-batch position in the loss of step 0, per token."""
    w: dict[int, Fraction] = defaultdict(Fraction)
    per_token = spec.loss_weight()
    for rank in range(spec.dp):  # the data-parallel ranks: a pipeline's share one batch
        for mb in range(spec.accum):
            for n in sequence_ids(0, rank, mb, spec.micro, spec.dp, spec.seqs):
                w[n] += per_token
    return dict(w)


def compare(a: Spec, b: Spec) -> Agreement:
    found = _Differences(a, b)
    if a.model != b.model:
        found.differ("the models differ", _model(a), _model(b), "model")
    found.batches()
    if a.data != b.data:  # both resolved (DataConfig.resolved): meaning, not spelling
        found.differ("the data sources differ", _data(a), _data(b), "data")
    found.optimizers()
    if a.seed != b.seed:
        found.differ("the seeds differ (so do the initial weights)", a.seed, b.seed, "seed")
    if a.steps != b.steps and not (a.optim.decay_steps and b.optim.decay_steps):
        found.differ(
            "the run lengths differ, and with them the cosine LR schedule",
            a.steps,
            b.steps,
            "steps",
            hint="give both the same `steps`, or fix `decay_steps` in the optimizer",
        )
    numerics = a.numerics.effective(a.sync).differences(b.numerics.effective(b.sync))
    return Agreement((a.tokens_per_step, b.tokens_per_step), tuple(found.out), tuple(numerics))


@dataclass
class _Differences:
    """What `compare` finds, one diagnostic per difference, at b's line with a note at a's."""

    a: Spec
    b: Spec
    out: list[Diagnostic] = field(default_factory=list)

    def differ(self, what: str, va: object, vb: object, key: str, hint: str | None = None) -> None:
        a, b = self.a, self.b
        span_b, span_a = b.where.get(key), a.where.get(key)
        self.out.append(
            Diagnostic(
                "disagree",
                f"{what}: {vb} here, {va} in {a.source.path}",
                span_b,
                hint=hint,
                path=b.source.path,
                notes=(Note(f"{a.source.path} has {va}", span_a, a.source.path),) if span_a else (),
            )
        )

    def batches(self) -> None:
        """The same sequences, each with the same weight in the loss."""
        a, b = self.a, self.b
        if (a.seqs, a.seq_len) != (b.seqs, b.seq_len):
            self.differ(
                "the global batches differ",
                f"{a.seqs} x {a.seq_len}",
                f"{b.seqs} x {b.seq_len}",
                "batch",
                hint="an update must see the same sequences: same sequences x tokens",
            )
            return
        wa, wb = sequence_weights(a), sequence_weights(b)
        if wa != wb:
            n = min(n for n in set(wa) | set(wb) if wa.get(n) != wb.get(n))
            self.differ(
                f"sequence {n} of the global batch is weighted differently",
                wa.get(n, 0),
                wb.get(n, 0),
                "micro",
            )

    def optimizers(self) -> None:
        oa, ob = self.a.optim, self.b.optim
        if oa == ob:
            return
        fields = [
            f.name for f in dataclasses.fields(oa) if getattr(oa, f.name) != getattr(ob, f.name)
        ]
        self.differ(
            "the optimizers differ in " + ", ".join(fields),
            ", ".join(f"{f}={getattr(oa, f)}" for f in fields),
            ", ".join(f"{f}={getattr(ob, f)}" for f in fields),
            "optimizer",
        )


def _model(s: Spec) -> str:
    m = s.model
    return (
        f"{s.model_name} (n_layer={m.n_layer}, n_head={m.n_head}, n_embd={m.n_embd}, "
        f"block={m.block_size}, vocab={m.vocab_size})"
    )


def _data(s: Spec) -> str:
    d = s.data
    if d.source == "corpus":
        return "the embedded corpus"
    return d.kind + " " + ", ".join(f'"{x}"' for x in d.sources)


# Spec fields that say nothing about what a step computes or how ranks talk: where the
# text came from. Every other field is compared, so a setting added to Spec is compared
# without anyone remembering to (tests/cli/test_flags.py adds one and checks).
NOT_MEANING = {
    "source": "the file's text and path",
    "where": "source positions",
}
# fields that `meaning` shows in words, under names of their own
NAMED = {
    "model_name",
    "model",
    "world",
    "seqs",
    "seq_len",
    "micro",
    "accum",
    "steps",
    "seed",
    "data",
    "optim",
    "strategy",
    "streams",
}
_POSITIONS = {"span", "spans", "after_spans", "where"}


def meaning(spec: Spec) -> dict[str, str]:
    """What a schedule computes, field by field, without its spelling: no path, text,
    comments or positions, and the data source resolved. Ranks prove at start-up that
    theirs are equal (schedc/exec/train.py), so two files that differ only in comments, or in
    `data corpus` written or left out, run together, and a difference is named by field.

    Every field of Spec but NOT_MEANING's is here: NAMED's in words, each other one (the
    numerics, recompute, the mesh, programs, the budget, and whatever is added later) as
    its value's text; the numerics one entry per setting (`numerics.compute`, ...)."""
    st = spec.strategy
    if isinstance(st, DDPSpec):
        how = f"ddp overlap={st.overlap} no_sync={st.no_sync} " + " ".join(
            f"{b.name}={','.join(b.params)}" for b in st.buckets
        )
    elif isinstance(st, FSDPSpec):
        how = (
            f"fsdp prefetch={st.prefetch_forward},{st.prefetch_backward} "
            f"reshard={st.reshard_after_forward} no_sync={st.no_sync} "
            + " ".join(f"{u.name}={','.join(u.params)}{'(keep)' * u.keep}" for u in st.units)
        )
    else:
        how = "single"
    out = {
        "model": _model(spec),
        "world": str(spec.world),
        "batch": f"{spec.seqs} x {spec.seq_len}",
        "split": f"micro {spec.micro} x {count(spec.accum, 'micro-step')}",
        "steps": str(spec.steps),
        "seed": str(spec.seed),
        "data source": _data(spec),
        "optimizer": repr(spec.optim),
        "strategy": how,
        "streams": ", ".join(
            f"{k.value}:{v}" for k, v in sorted(spec.streams.items(), key=lambda kv: kv[0].value)
        ),
    }
    for f in dataclasses.fields(spec):
        if f.name in NAMED or f.name in NOT_MEANING:
            continue
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value) and f.name == "numerics":
            for sub in dataclasses.fields(value):
                out[f"numerics.{sub.name}"] = _text(getattr(value, sub.name))
        else:
            out[f.name] = _text(value)
    return out


def _text(v) -> str:
    """A value as text, without source positions, the same on every rank."""
    if v is None:
        return "none"
    if isinstance(v, Enum):
        return str(v.value)
    if isinstance(v, (frozenset, set)):
        return "{" + ", ".join(sorted(_text(x) for x in v)) + "}"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_text(x) for x in v) + "]"
    if isinstance(v, dict):
        items = sorted((_text(k), _text(x)) for k, x in v.items())
        return "{" + ", ".join(f"{k}: {x}" for k, x in items) + "}"
    if dataclasses.is_dataclass(v):
        parts = (
            f"{f.name}={_text(getattr(v, f.name))}"
            for f in dataclasses.fields(v)
            if f.name not in _POSITIONS
        )
        return f"{type(v).__name__}({', '.join(parts)})"
    return str(v)
