"""The run's plain settings: `world`, `micro`, `accumulate`, `steps`, `seed`, `batch`,
`memory`, `data`, the top-level toggles (`tf32`, `compile`), and those a schedule cannot do
without."""

from __future__ import annotations

from dataclasses import dataclass

from schedc.lang.resolve.context import Context, prefer
from schedc.lang.resolve.values import LIMITS, int_of, size_of
from schedc.lang.syntax import Batch, Data, Memory, Name, Setting, Toggle
from schedc.model.config import DataConfig

DEFAULT_STEPS = 20
DEFAULT_SEED = 1337
MISSING_HINTS = {
    "model": "add `model gpt2` (or gpt2-medium, mini, tiny, nano, ...)",
    "world": "add `world 8`: the number of data-parallel ranks",
    "batch": "add `batch 512 x 1024`: global sequences x tokens per sequence",
    "micro": "add `micro 16` (sequences per rank per micro-step) or `accumulate 4`",
}


@dataclass(frozen=True)
class Run:
    """The plain settings as read; a number is None where it is absent or was refused."""

    world: int | None
    micro: int | None
    accumulate: int | None
    steps: int  # flag > file > default
    seed: int
    batch: Batch | None
    seqs: int | None  # global batch, sequences
    seq_len: int | None  # tokens per sequence
    memory: int | None  # the per-rank budget, bytes
    data: DataConfig


def read_run(cx: Context) -> Run:
    """The plain settings, each given at most once."""
    settings: dict[str, int | None] = {}
    for s in cx.all(Setting):
        if cx.once(s.key, s.span, f"'{s.key}'"):
            lo, hi = LIMITS[s.key]
            settings[s.key] = int_of(cx.diag, s.value, s.key, lo, hi)
    batch = cx.single(Batch, "batch", "the batch")
    seqs = seq_len = None
    if batch:
        seqs = int_of(cx.diag, batch.sequences, "global batch sequences", 1, 1 << 31)
        seq_len = int_of(cx.diag, batch.tokens, "tokens per sequence", 1, 1 << 20)
    memory = None
    if (m := cx.single(Memory, "memory", "the memory budget")) is not None:
        memory = size_of(cx.diag, m.size, "memory")
    return Run(
        world=settings.get("world"),
        micro=settings.get("micro"),
        accumulate=settings.get("accumulate"),
        steps=prefer(cx.ov.steps, settings.get("steps"), DEFAULT_STEPS),
        seed=prefer(cx.ov.seed, settings.get("seed"), DEFAULT_SEED),
        batch=batch,
        seqs=seqs,
        seq_len=seq_len,
        memory=memory,
        data=_data(cx),
    )


def _data(cx: Context) -> DataConfig:
    """The data source resolved (DataConfig.resolved): the spec holds its meaning."""
    d = cx.single(Data, "data", "the data source")
    if d is None:
        return DataConfig().resolved()
    if isinstance(d.source, Name):
        if d.source.text != "corpus":
            cx.err(
                "unknown-name",
                f"unknown data source '{d.source.text}'",
                d.source.span,
                hint='write `data corpus` for the embedded corpus, or a "quoted/path"',
            )
        return DataConfig("corpus", "text")
    seen: set[str] = set()
    for s in (d.source, *d.also):
        if not s.text:
            cx.err("value-range", "the data path is empty", s.span)
        elif s.text in seen:
            cx.err(
                "duplicate",
                f"'{s.text}' is listed twice: its tokens would be read twice a pass",
                s.span,
            )
        seen.add(s.text)
    if d.also and d.kind == "text":
        cx.err(
            "value-range",
            "a list of data sources is read as token shards; text is one file",
            d.also[0].span,
            hint='write `data tokens "a.bin", "b.bin"`, or one text file',
        )
    return DataConfig(d.source.text, d.kind, tuple(s.text for s in d.also)).resolved()


def read_toggles(cx: Context) -> dict[str, bool]:
    """The top-level switches: `tf32 on`, `compile off`."""
    toggles = {}
    for t in cx.all(Toggle):
        if cx.once(t.key, t.span, f"'{t.key}'"):
            toggles[t.key] = t.value.on
    return toggles


def require(cx: Context, model_name: str | None, run: Run) -> None:
    """What a schedule cannot do without: a model, a world, a batch and how it splits."""
    missing = [
        k
        for k, present in (
            ("model", model_name is not None),
            ("world", "world" in cx.seen),
            ("batch", run.batch is not None),
        )
        if not present
    ]
    if not ("micro" in cx.seen or "accumulate" in cx.seen or "pipeline.microbatches" in cx.seen):
        missing.append("micro")
    for key in missing:  # about the whole file, so no line to point at
        cx.err("missing-setting", f"the schedule has no '{key}'", None, hint=MISSING_HINTS[key])
