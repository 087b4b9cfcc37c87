"""The memory ledger predicts the measured peak: states + buffers + activations (issue 16).

Each rank's predicted peak (schedc/passes/memory.py, activations included) must be within
10% of its measured peak (the bound above holds for the peak at op boundaries, as a
sub-millisecond transient inside an op is seen only when the sampling thread runs then):
on a CPU the live heap (schedc/exec/heap.py: glibc's in-use bytes, read between ops and
every millisecond) grown over the bytes held before the plan runs (states and the step's
token batches), over the steps after the first (the first creates AdamW's moments).
Bundled CPU schedules (DDP, FSDP and HSDP, worlds 1-4, with and without recompute), and
generated ones, DDP and FSDP (worlds 1-4; FSDP with 2-3 micro-steps, keep units, prefetch,
no_sync, some with recompute). FSDP holds because the executor frees at points the plan
names: a collective's buffers when a wait or the update retires it, a unit at its free.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from schedc.compiler import compile_text
from tests.goldens import REPO
from tests.strategies import cases, examples

SCHEDULES = REPO / "schedules"
BUNDLED = ["tiny_1gpu", "tiny_4gpu", "tiny_ddp_overlap", "tiny_fsdp_prefetch", "tiny_hsdp"]
TOLERANCE = 0.10


def check_measured(pool, text: str, steps: int = 2) -> list[tuple[int, int]]:
    c = compile_text(text)
    world = c.spec.world
    result = pool.run(text, world, steps, heap=True, timeout=120)
    out, settled = [], []
    for rank, mem in enumerate(result.memory):
        report = c.memories.get(rank, c.memory)
        predicted, measured = report.peak, mem["heap_peak"]
        out.append((predicted, measured))
        settled.append(report.settled_peak)
        print(
            f"rank {rank}: predicted {predicted:,} (between ops {report.settled_peak:,}) "
            f"measured {measured:,}"
        )
    for rank, (predicted, measured) in enumerate(out):
        # never under-predicted by more than 10%
        assert predicted - measured >= -TOLERANCE * measured, (text, rank, out)
        # and not over-predicted either: an op's own transients (AdamW's foreach
        # temporaries, a layer's scratch) live for well under a millisecond and the
        # sampling thread sees them only when it happens to run then (on a loaded machine
        # ranks of one schedule measured 21.6 and 19.5 MB), so the bound above the
        # measurement is held by the peak at op boundaries, which is read exactly
        assert settled[rank] - measured <= TOLERANCE * measured, (text, rank, out, settled)
    return out


@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_bundled_schedules_peak_as_predicted(pool, name, recompute):
    text = (SCHEDULES / f"{name}.sched").read_text()
    if recompute:
        text += "\nrecompute h.0 .. h.3\n"
    check_measured(pool, text.replace("steps 40", "steps 2"))


@pytest.mark.parametrize("name", ["tiny_1gpu", "tiny_4gpu", "tiny_fsdp_prefetch"])
@pytest.mark.parametrize(
    "extra", ["loss chunk 64", "loss chunk 64\nrecompute h.0 .. h.3"], ids=["chunk", "chunk+rc"]
)
def test_chunked_loss_peaks_as_predicted(pool, name, extra):
    """The head's chunked loss (`loss chunk N`): one chunk's logits instead of the micro-batch's."""
    text = (SCHEDULES / f"{name}.sched").read_text() + f"\n{extra}\n"
    check_measured(pool, text.replace("steps 40", "steps 2"))


def tiny(case) -> str:
    """The case on the tiny model at 64 tokens: activations and states large enough that the
    heap's own bookkeeping (Python objects, gloo's buffers: tens of KiB) is noise, as on
    any real model."""
    text = case.text().replace("model nano\n", "model tiny { n_layer = 2 }\n", 1)
    text = text.replace("model nano", "model tiny", 1)
    return text.replace(f"x {case.seq_len}", "x 64")


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(kinds=("ddp",), max_k=3))
def test_generated_schedules_peak_as_predicted(pool, case):
    check_measured(pool, tiny(case))


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(kinds=("fsdp",), min_k=2, max_k=3))
def test_generated_fsdp_schedules_peak_as_predicted(pool, case):
    """FSDP, worlds 1-4, 2-3 micro-steps: keep units, prefetch, no_sync, streams, recompute
    as tests/strategies.py draws them."""
    check_measured(pool, tiny(case))


@pytest.mark.parametrize(
    "name,policy,no_sync",
    [
        ("tiny_fsdp_prefetch", "precision bf16", "off"),
        ("tiny_fsdp_prefetch", "precision bf16", "on"),  # FSDP2's fp32 accumulator
        ("tiny_fsdp_prefetch", "precision bf16 { reduce = bf16 }", "on"),
        ("tiny_ddp_overlap", "precision bf16 { reduce = bf16 }", None),
    ],
    ids=["fsdp-bf16", "fsdp-bf16-no-sync", "fsdp-bf16-reduce-no-sync", "ddp-bf16-reduce"],
)
def test_bf16_policies_peak_as_predicted(pool, name, policy, no_sync):
    """Under bf16 compute, gathers and reductions every buffer is counted in its own dtype
    (issue 13): bf16 gathered units and unsharded gradients, the reduce-dtype casts, and
    under no_sync with fp32 reductions the fp32 accumulator the micro-steps fold into."""
    text = (SCHEDULES / f"{name}.sched").read_text().replace("steps 40", "steps 2")
    text = text.replace("memory 64 MiB", "") + f"\n{policy}\n"
    if no_sync is not None:
        text = text.replace("no_sync off", f"no_sync {no_sync}")
    check_measured(pool, text)
