"""Batch arithmetic: the global batch is micro x accumulation x world exactly, a sequence
fits the model's context, and one step's graph stays small enough to compile."""

from __future__ import annotations

import math
from dataclasses import dataclass

from schedc.ir.spec import DDPSpec, FSDPSpec
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.settings import Run
from schedc.model.arch import GPTConfig

# ops in one step's graph: compile time and memory grow with them (measured on a 2-core CPU:
# 34,817 ops in 10.8 s and 250 MB; 280,000 took 90 s and 1.7 GB), so a step is bounded to
# what compiles in about 10 s and 300 MB: GPT-2 124M FSDP with a unit a layer and 300
# micro-steps, or one process with 1,100
MAX_OPS = 32_000


def ops_per_step(
    model: GPTConfig, accum: int, strategy, recompute: frozenset[str], hsdp: bool
) -> int:
    """At most the ops of one step's graph (passes/graph.py): per micro-step a forward and
    a backward of every layer and each recompute; DDP's all-reduce of each bucket, FSDP's
    two gathers and two frees of each unit and its reduce-scatter (and HSDP's all-reduce),
    every micro-step (fewer under no_sync or for kept units); the update."""
    layers = len(model.layers)
    n = accum * (2 * layers + len(recompute)) + 1
    if isinstance(strategy, DDPSpec):
        n += accum * len(strategy.buckets)
    elif isinstance(strategy, FSDPSpec):
        n += accum * len(strategy.units) * (6 if hsdp else 5)
    return n


@dataclass(frozen=True)
class Terms:
    """What the arithmetic's factors are called where it is written: a pipeline's
    accumulation is its `microbatches`, and its ranks that share the batch are dp."""

    accum: str = "accumulate"  # the word, and where cx.seen keeps its statement
    key: str = "accumulate"
    ranks: str = "world"


def split_batch(
    cx: Context, run: Run, model: GPTConfig | None, terms: Terms = Terms()
) -> tuple[int | None, int | None]:
    """(micro, accumulation): the one not written derived from the other, both checked
    against the global batch; None where they do not fit it or make too many ops."""
    micro, accum = _arithmetic(cx, run, terms)
    if model is not None and accum is not None and 2 * accum * len(model.layers) > MAX_OPS:
        _too_many_ops(cx, accum, 2 * accum * len(model.layers), "forward and backward")
        micro, accum = None, None
    if model is not None and run.seq_len is not None and run.seq_len > model.block_size:
        assert run.batch is not None  # a sequence length is read from the batch
        cx.err(
            "context-length",
            f"sequences of {run.seq_len:,} tokens do not fit the model's context of "
            f"{model.block_size:,}",
            run.batch.tokens.span,
            hint=f"use at most {model.block_size} tokens, or raise `block` in the model",
        )
    return micro, accum


def _arithmetic(cx: Context, run: Run, t: Terms) -> tuple[int | None, int | None]:
    seqs, world, micro, accum = run.seqs, run.world, run.micro, run.accumulate
    if (
        seqs is None
        or world is None
        or ("micro" in cx.seen and micro is None)
        or (t.key in cx.seen and accum is None)
    ):
        return micro, accum
    if micro is None and accum is None:
        return None, None
    if micro is not None and accum is not None:
        if micro * accum * world != seqs:
            cx.err(
                "batch-arithmetic",
                f"micro {micro} x {t.accum} {accum} x {t.ranks} {world} = "
                f"{micro * accum * world:,} sequences, but the global batch is {seqs:,}",
                cx.seen[t.key],
                hint=_batch_hint(seqs, world, t.ranks),
            )
            return None, None
        return micro, accum
    if micro is not None:
        if seqs % (micro * world):
            cx.err(
                "batch-arithmetic",
                f"global batch {seqs:,} is not micro {micro} x {t.ranks} {world} x a whole "
                "number of micro-steps",
                cx.seen["micro"],
                hint=_batch_hint(seqs, world, t.ranks),
            )
            return None, None
        return micro, seqs // (micro * world)
    assert accum is not None
    if seqs % (accum * world):
        cx.err(
            "batch-arithmetic",
            f"global batch {seqs:,} is not {t.accum} {accum} x {t.ranks} {world} x a whole "
            "number of sequences",
            cx.seen[t.key],
            hint=_batch_hint(seqs, world, t.ranks),
        )
        return None, None
    return seqs // (accum * world), accum


def bound_ops(
    cx: Context,
    model: GPTConfig | None,
    accum: int | None,
    strategy: DDPSpec | FSDPSpec | None,
    recompute: frozenset[str],
    hsdp: bool,
) -> int | None:
    """The accumulation, or None when the whole step (collectives, frees and recomputes
    counted) has more than MAX_OPS ops."""
    if model is not None and accum is not None:
        n = ops_per_step(model, accum, strategy, recompute, hsdp)
        if n > MAX_OPS:
            _too_many_ops(cx, accum, n, "forward, backward, collective and free")
            return None
    return accum


def _too_many_ops(cx: Context, accum: int, n: int, what: str) -> None:
    cx.err(
        "value-range",
        f"{accum:,} micro-steps make {n:,} {what} ops per step; schedc compiles at most "
        f"{MAX_OPS:,} (about 10 s and 300 MB on a 2-core CPU)",
        cx.seen.get("micro") or cx.seen.get("accumulate") or cx.seen.get("pipeline.microbatches"),
        hint="use a larger `micro` (fewer micro-steps per update)",
    )


def _batch_hint(seqs: int, world: int, ranks: str = "world") -> str:
    if seqs % world:
        return f"the global batch must be a multiple of {ranks} {world}"
    # the smallest micro sizes that divide seqs / world, found among divisors up to its root
    # (a scan of every size up to seqs would take minutes for a batch of 2**31)
    n = seqs // world
    small = [b for b in range(1, math.isqrt(n) + 1) if n % b == 0]
    divisors = sorted(set(small) | {n // b for b in small})[:4]
    return "for example " + ", ".join(f"micro {b} (k={n // b})" for b in divisors)
