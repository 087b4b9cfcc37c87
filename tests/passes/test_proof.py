"""The proof (passes/prove.py): every schedule's plans are proved to compute one process's
update, and every plan mutation (tests/plan_mutations.py) is refuted, with its located
diagnostic, by the proof alone."""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from schedc.compiler import Compiled, compile_file, compile_text
from schedc.lang.diagnostics import CompileError
from schedc.passes.agree import meaning
from schedc.passes.prove import prove
from schedc.passes.prove_rank import Refuted
from tests.goldens import REPO
from tests.plan_mutations import CLASSES, on_rank
from tests.strategies import PRECISIONS, cases, examples, hsdp_cases, program_lines, programs_of
from tests.strategies import tally as tally_case

SCHEDULES = sorted((REPO / "schedules").glob("*.sched"))

# what the bundled tiny schedules do not: FSDP's upcast under no_sync (the accumulator's
# folds), recompute, a chunked loss, bf16, and per-rank programs written out
UPCAST = """model tiny
world 2
batch 8 x 64
micro 2
precision bf16 { compute = bf16  gather = bf16  reduce = fp32 }
fsdp {
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0 .. h.1
  unit u2 = h.2 .. h.3, head
  no_sync on
}
"""
RECOMPUTE = """model tiny
world 2
batch 8 x 64
micro 1
recompute h.1, h.2
loss chunk 2
fsdp {
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0 .. h.1
  unit u2 = h.2 .. h.3, head
}
"""
SOURCES = {
    "tiny_ddp_overlap": (REPO / "schedules/tiny_ddp_overlap.sched").read_text(),
    "tiny_fsdp_prefetch": (REPO / "schedules/tiny_fsdp_prefetch.sched").read_text(),
    "tiny_hsdp": (REPO / "schedules/tiny_hsdp.sched").read_text(),
    "tiny_4gpu": (REPO / "schedules/tiny_4gpu.sched").read_text(),
    "upcast": UPCAST,
    "recompute": RECOMPUTE,
}
# every bundled pipeline schedule: the plan mutations apply to their bound plans too
PIPELINES = {p.stem: p.read_text() for p in sorted((REPO / "schedules/pipeline").glob("*.sched"))}


def bounds_of(c: Compiled) -> list:
    return [c.bound(r) for r in range(c.spec.world)]


@pytest.mark.parametrize("path", SCHEDULES, ids=lambda p: p.stem)
def test_every_bundled_schedule_is_proved(path):
    c = compile_file(path)
    assert c.proof is not None
    line = c.proof.line()
    assert f"every update reads {c.spec.seqs:,} sequences once" in line, line
    assert re.search(rf"abstract execution of {c.spec.world} plans?, [\d.]+ ms\)$", line), line


def test_the_written_out_program_of_every_source_is_proved():
    """Programs written out (`--dump program`, one per rank where ranks differ) compile back
    with the proof, as every written program must."""
    for name, text in SOURCES.items():
        progs, world = programs_of(text), compile_text(text).spec.world
        every = "\n".join(program_lines(progs))
        each = "\n".join(line for r in range(world) for line in program_lines(progs, r))
        for written in (every, each):
            c = compile_text(f"{text}\n{written}\n", f"{name}.sched")
            assert c.proof is not None and c.proof.ranks == world, name


def refute(spec, variant) -> Refuted:
    with pytest.raises(Refuted) as e:
        prove(spec, variant)
    return e.value


def test_every_plan_mutation_is_refuted_with_where():
    """Every variant of every class on every source is refuted, at an instruction of the
    rank it names or with the ranks named; every class has variants."""
    counts: Counter = Counter()
    for name, text in {**SOURCES, **PIPELINES}.items():
        c = compile_text(text, f"{name}.sched")
        bounds = bounds_of(c)
        for cls, mutate in CLASSES.items():
            for label, variant in mutate(c.spec, bounds):
                e = refute(c.spec, variant)
                assert 0 <= e.rank < c.spec.world, (name, label)
                assert e.index is not None or "rank" in e.message, (name, label, e.message)
                counts[cls] += 1
                tally_case("proof", cls)
    assert set(counts) == set(CLASSES), set(CLASSES) - set(counts)
    assert sum(counts.values()) >= 150, counts


def test_a_refuted_plan_is_a_located_compile_error():
    """Through the checker: the error names the parameter piece, the rank and the
    micro-step, at the strategy's line, with the rank's plan around the instruction."""
    from schedc.lang.diagnostics import Diagnostics
    from schedc.passes.check import check_proof

    c = compile_text(SOURCES["tiny_ddp_overlap"], "x.sched")
    bounds = bounds_of(c)
    _, variant = next(CLASSES["param-left-out"](c.spec, bounds))
    diag = Diagnostics(c.source)
    assert check_proof(c.spec, variant, diag) is None
    [err] = diag.errors
    text = err.render(c.source)
    # every rank leaves it out: the proof by classes finds it on the representative, rank 0
    assert "[proof]" in text and "missing" in text and "on rank 0" in text, text
    assert "ERROR HERE" in text and "optimizer.step" in text, text


def test_faults_the_run_suite_injects_are_refuted_statically():
    """The executor faults of tests/faults.py that change what the plan computes, applied to
    the bound plans instead: the proof refutes each before anything runs."""
    import dataclasses
    from types import SimpleNamespace

    from tests.faults import FAULTS

    for text, fault in [
        (SOURCES["tiny_ddp_overlap"], "skip-accum-scale"),
        (SOURCES["tiny_ddp_overlap"], "reduce-first-micro-step"),
        (SOURCES["tiny_fsdp_prefetch"], "drop-gather-wait"),
        (SOURCES["tiny_hsdp"], "skip-replicate-allreduce"),
    ]:
        c = compile_text(text)
        variant = []
        for b in bounds_of(c):
            ex = SimpleNamespace(
                plan=b.plan,
                spec=c.spec,
                units=c.spec.kind.value == "fsdp",
                loss_scale=float(b.loss_scale),
            )
            FAULTS[fault](ex, "")
            scale = b.loss_scale if ex.loss_scale == float(b.loss_scale) else Fraction(1)
            variant.append(dataclasses.replace(b, plan=ex.plan, loss_scale=scale))
        e = refute(c.spec, variant)
        assert e.message, fault
        tally_case("proof", f"fault {fault}")


@settings(max_examples=examples(60))
@given(case=cases(kinds=("ddp", "fsdp"), precisions=tuple(PRECISIONS)), data=st.data())
def test_generated_schedules_are_proved_and_their_mutants_refuted(case, data):
    text = case.text()
    note(text)
    c = compile_text(text)  # the proof runs in every compile; a refutation raises
    assert c.proof is not None
    bounds = bounds_of(c)
    cls = data.draw(st.sampled_from(sorted(CLASSES)))
    variants = list(CLASSES[cls](c.spec, bounds))
    if variants:
        label, variant = data.draw(st.sampled_from(variants))
        note(f"{cls}: {label}")
        refute(c.spec, variant)
        tally_case("proof", cls)


@settings(max_examples=examples(20))
@given(case=hsdp_cases())
def test_generated_hsdp_schedules_are_proved(case):
    try:
        c = compile_text(case.text())
    except CompileError as e:  # pragma: no cover - hsdp_cases draws valid schedules
        raise AssertionError(e.render()) from None
    assert c.proof is not None and c.proof.shards == case.mesh[1]
    e = refute(c.spec, next(CLASSES["replicate-skipped"](c.spec, bounds_of(c)))[1])
    assert "missing" in e.message or "never landed" in e.message, e.message


def test_a_rank_that_does_not_prove_binds_the_plan_rank_0_proved():
    """`schedc run` proves on rank 0 only (cli/run.py): every other rank compiles without
    the proof and binds its own plan, which is the plan the proof read, and the ranks agree
    on the plans' digest and the schedule's meaning before step 1, which together tell
    every source apart."""
    for name, text in {**SOURCES, **PIPELINES}.items():
        proved = compile_text(text, f"{name}.sched")
        mine = compile_text(text, f"{name}.sched", prove=False)
        assert mine.proof is None and not mine.bounds
        assert mine.plans_digest == proved.plans_digest, name
        for r in {1, proved.spec.world - 1}:
            assert mine.bound(r) == proved.bound(r), (name, r)
    seen = {
        (c.plans_digest, str(sorted(meaning(c.spec).items())))
        for c in map(compile_text, (*SOURCES.values(), *PIPELINES.values()))
    }
    assert len(seen) == len(SOURCES) + len(PIPELINES)
    a, b = (compile_text(SOURCES[n]).plans_digest for n in ("upcast", "recompute"))
    assert a != b


def _scaled(text: str, world: int, mesh: str | None = None, k: int = 2) -> str:
    """A tiny source at `world` ranks, `k` micro-steps of its micro-batch a rank."""
    micro = int(re.search(r"^micro (\d+)", text, re.M).group(1))
    text = re.sub(r"^world \d+", f"world {world}", text, flags=re.M)
    text = re.sub(r"^batch \d+", f"batch {k * micro * world}", text, flags=re.M)
    return re.sub(r"^mesh .*$", f"mesh {mesh}", text, flags=re.M) if mesh else text


AT_1024 = [  # (source, mesh, micro-steps, the classes tried there; None: every one)
    ("tiny_ddp_overlap", None, 2, None),  # k = 2: accumulation's classes
    ("tiny_hsdp", "32 x 32", 1, None),  # HSDP's classes hold FSDP's
    ("upcast", None, 2, ("fold-skipped",)),  # no_sync's upcast: its fold
]


@pytest.mark.parametrize(("name", "mesh", "k", "only"), AT_1024)
def test_a_mutation_of_one_rank_in_a_world_of_1024_is_refuted(name, mesh, k, only):
    """Every class with a variant here, its first variant made on rank 500 of 1,024 (not the
    last: a rank whose groups and slices are in the middle of the mesh), is refuted, located
    (issue #45: the proof at cluster scale still refutes every class)."""
    c = compile_text(_scaled(SOURCES[name], 1024, mesh, k), f"{name}_1024.sched")
    bounds = bounds_of(c)
    refuted = []
    with on_rank(500):
        for cls, mutate in CLASSES.items():
            first = next(mutate(c.spec, bounds), None) if cls in (only or CLASSES) else None
            if first is None:
                continue
            label, variant = first
            e = refute(c.spec, variant)
            assert e.index is not None or "rank" in e.message, (label, e.message)
            refuted.append(cls)
    assert refuted == [cls for cls in _with_variants(c, bounds) if cls in (only or CLASSES)]


def _with_variants(c: Compiled, bounds: list) -> list[str]:
    """The classes with a variant on rank 500 of these plans."""
    with on_rank(500):
        return [cls for cls, mutate in CLASSES.items() if next(mutate(c.spec, bounds), None)]


def test_the_world_1024_cases_cover_every_class_but_the_pipelines_own():
    """Between them the sources above have a variant of every class (a pipeline's
    rendezvous circle needs one stage a rank over many micro-batches; it is refuted on the
    bundled pipelines: tests/passes/test_pipeline_proof.py)."""
    covered = set()
    for name, mesh, k, only in AT_1024:
        c = compile_text(_scaled(SOURCES[name], 1024, mesh, k), f"{name}.sched", prove=False)
        covered |= set(_with_variants(c, bounds_of(c))) & set(only or CLASSES)
    assert set(CLASSES) - covered == {"rendezvous-in-a-circle"}
