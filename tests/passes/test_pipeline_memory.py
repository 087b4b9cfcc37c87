"""The pipeline's memory ledger (passes/pipeline_memory.py, #31): per rank, along its program.

What a schedule keeps in flight is the schedule's: GPipe holds all m micro-batches on every
rank, 1F1B min(p - r, m) on rank r; the bytes are the DP ledger's per-layer rule (ir/sizes.py
`layer_acts`) plus the stage's output and the transfers; FSDP per stage shards the states;
a pipeline file's `memory` budget is checked per rank, located. torch-free; the executor's
measured heap is held to it in tests/exec/test_pipeline_memory_measured.py.
"""

from __future__ import annotations

import pytest

from schedc.compiler import compile_file, compile_text
from schedc.ir.sizes import layer_acts, padded
from schedc.lang.diagnostics import CompileError
from schedc.model.arch import FP32
from schedc.passes.pipeline_memory import in_flight, stage_params
from tests.goldens import REPO

FOUR = """model tiny
world 4
batch 16 x 64
micro 2
steps 40
{memory}
pipeline {{
  stage s0 = embed, h.0
  stage s1 = h.1
  stage s2 = h.2
  stage s3 = h.3, head
  schedule {schedule}
}}
"""


def four(schedule: str, memory: str = ""):
    return compile_text(FOUR.format(schedule=schedule, memory=memory))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_micro_batches_in_flight_are_the_schedules(schedule):
    c = four(schedule)
    assert c.pipeline is not None
    m, p = c.spec.accum, 4
    got = {r: in_flight(prog) for r, prog in c.pipeline.programs.items()}
    want = {r: m if schedule == "gpipe" else min(p - r, m) for r in range(p)}
    assert got == want


def test_rank_0_holds_what_its_schedule_keeps_in_flight():
    """Rank 0 (embed, h.0): per micro-batch in flight, what its two layers save and the
    stage's output (N C fp32), plus one received output gradient and a backward's scratch at
    the peak; GPipe keeps m = 8, 1F1B p = 4, so GPipe holds exactly 4 micro-batches more."""
    gpipe, ofob = four("gpipe"), four("1f1b")
    spec = gpipe.spec
    ncx = spec.micro * spec.seq_len * spec.model.n_embd * FP32
    per_mb = sum(layer_acts(spec, layer).saved for layer in ("embed", "h.0")) + ncx
    acts = {n: c.pipeline.memory[0].activations for n, c in (("g", gpipe), ("1", ofob))}
    assert acts["g"] - acts["1"] == 4 * per_mb
    # at B[s0]@mb0: with the received gradient of micro-batch 0's output, and h.0's backward
    # scratch on top (the larger of its two layers')
    assert acts["1"] == 4 * per_mb + ncx + layer_acts(spec, "h.0").bwd


def test_states_are_the_ranks_stages_and_the_tied_copy():
    c = four("1f1b")
    spec, mem = c.spec, c.pipeline.memory
    numel = {p.name: p.numel for p in spec.model.params}
    for r in range(4):
        want = sum(numel[name] for name in stage_params(spec, r)) * 4 * FP32
        assert mem[r].states == want
    assert "wte.weight" in stage_params(spec, 0) and "wte.weight" in stage_params(spec, 3)


def test_fsdp_per_stage_keeps_shards_and_gathers_its_units():
    """2 x 2 DP x PP, FSDP per stage: after the step a rank holds its units' shards with
    their gradient shards (16 bytes a parameter / dp, padded), and gathered every unit of
    its stage in the gather dtype."""
    c = compile_file(REPO / "schedules/pipeline/tiny_pp2_dp2_fsdp.sched")
    spec, ps = c.spec, c.spec.pipeline
    numel = {p.name: p.numel for p in spec.model.params}
    for r, m in c.pipeline.memory.items():
        units = [sum(numel[p] for p in u.params) for u in ps.units if u.stage == r]
        if r == 1:  # the head's stage keeps a copy of the tied unit
            units.append(numel["wte.weight"])
        assert m.states == sum(padded(n, 2) // 2 for n in units) * 4 * FP32
        assert m.gathered_peak == sum(padded(n, 2) for n in units) * spec.numerics.gather.nbytes


def test_ddp_buckets_per_stage_hold_the_one_buckets_bytes():
    """DDP per stage: each bucket of the ddp block is a flat copy in the reduce dtype from
    its stage's last backward to the update; together the bytes of one bucket a stage (the
    head's tied copy with the head's bucket), so the ledger is the same as without them."""
    path = REPO / "schedules/pipeline/tiny_pp2_dp2_ddp.sched"
    text = path.read_text()
    c, one = compile_file(path), compile_text(text[: text.index("ddp {")], "one.sched")
    assert c.pipeline is not None and one.pipeline is not None
    numel = {p.name: p.numel for p in c.spec.model.params}
    for r, m in c.pipeline.memory.items():
        want = sum(numel[p] for p in stage_params(c.spec, r)) * c.spec.numerics.reduce.nbytes
        assert m.comm_peak == one.pipeline.memory[r].comm_peak == want
        assert (m.peak, m.states) == (one.pipeline.memory[r].peak, one.pipeline.memory[r].states)


def test_every_bundled_pipeline_has_a_ledger_and_check_says_it(capsys):
    from schedc.cli.main import main

    files = sorted((REPO / "schedules/pipeline").glob("*.sched"))
    for f in files:
        c = compile_file(f)
        assert c.pipeline is not None and set(c.pipeline.memory) == set(c.pipeline.programs)
        assert all(m.peak > m.states > 0 for m in c.pipeline.memory.values())
    assert main(["check", str(REPO / "schedules/pipeline/tiny_pp4_1f1b.sched")]) == 0
    out = capsys.readouterr().out
    assert "memory    peak per rank:" in out and "(4 in flight)" in out


def test_a_budget_gpipe_exceeds_and_1f1b_fits():
    with pytest.raises(CompileError) as e:
        four("gpipe", "memory 20 MiB")
    (d,) = e.value.diagnostics
    assert d.code == "memory-budget" and d.span.line == 6
    assert "pipeline rank 3" in d.message and "1f1b keeps at most p - r" in (d.hint or "")
    four("1f1b", "memory 20 MiB")  # compiles


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h1_holds_1f1b_peak_at_its_bubble(p):
    """ZB-H1's W's run before a forward that would hold more than 1F1B's first rank does:
    no rank holds more than min(p, m) micro-batches, and the step is still 3m + p - 1 at
    F = I = W = 1 (its bubble (p-1)/(3m+p-1))."""
    from schedc.passes.pipeline_check import prove
    from schedc.passes.pipeline_gen import Request, Schedule, generate, request_errors
    from schedc.passes.pipeline_sim import Costs, simulate

    for m in range(1, 3 * p + 2):
        req = Request(Schedule.ZB_H1, p, m)
        if request_errors(req):
            continue
        g = generate(req)
        assert max(in_flight(prog) for prog in g.programs.values()) <= min(p, m)
        timing = simulate(prove(g.pipeline, g.programs).graph, Costs(f=1, i=1, w=1))
        assert timing.step == 3 * m + p - 1


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_v_holds_1f1b_first_rank_peak_on_every_rank(p):
    """ZB-V's stages are half 1F1B's: a rank holds at most 2 min(p, m) of them (F run, W
    not), and every rank 2p once m >= 2p - 1, the activations of 1F1B's first rank (p
    micro-batches of a whole stage) on each rank, as Qi et al. (section 6) state."""
    from schedc.passes.pipeline_gen import Request, Schedule, generate

    for m in range(1, 3 * p + 2):
        g = generate(Request(Schedule.ZB_V, p, m, 2))
        held = [in_flight(g.programs[r]) for r in range(p)]
        assert max(held) <= 2 * min(p, m)
        assert m < 2 * p - 1 or held == [2 * p] * p


def test_zb_v_ledger_holds_one_wte_and_two_stages_on_rank_0(capsys):
    """The bundled ZB-V file: rank 0 holds s0 (embed) and s3 (head), so the tied wte once; the
    V's turn (s1 -> s2 on rank 1) passes the activation locally, counted once; check says
    the in-flight count."""
    from schedc.cli.main import main

    c = compile_file(REPO / "schedules/pipeline/tiny_pp2_zbv.sched")
    assert c.pipeline is not None
    cfg, ps = c.spec.model, c.spec.pipeline
    for r, stages in ((0, (0, 3)), (1, (1, 2))):
        held = {p.name for s in stages for layer in ps.stages[s].layers
                for p in cfg.layer_params(layer)}  # fmt: skip
        assert c.pipeline.memory[r].states == sum(cfg.param(n).numel for n in held) * 16
    assert main(["check", str(REPO / "schedules/pipeline/tiny_pp2_zbv.sched")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  memory"))
    assert line.count("(4 in flight)") == 2


@pytest.mark.parametrize("block", ["fsdp { }", "ddp { }", ""])
def test_one_rank_holding_embed_and_head_holds_one_wte(block):
    """Degree 1, two stages interleaved on one rank, two replicas: the tied wte is one
    parameter there (no head's copy), so FSDP shards it once and a stage's flat bucket
    copies it once: the states are the units' shards, the buckets every parameter once."""
    c = compile_text(
        "model tiny\nworld 2\nbatch 8 x 64\npipeline {\n  stage s0 = embed, h.0 .. h.1\n"
        "  stage s1 = h.2 .. h.3, head\n  degree 1\n  schedule interleaved\n"
        f"  microbatches 2\n}}\n{block}\n"
    )
    spec, m = c.spec, c.pipeline.memory[0]
    numel = sum(p.numel for p in spec.model.params)
    if block.startswith("fsdp"):
        units = [sum(spec.model.param(p).numel for p in u.params) for u in spec.pipeline.units]
        assert m.states == sum(padded(n, 2) // 2 for n in units) * 4 * FP32
        assert m.gathered_peak == sum(padded(n, 2) for n in units) * FP32
    else:
        assert m.states == numel * 4 * FP32
        assert m.comm_peak == numel * FP32  # the two stages' flat buckets, wte in one
