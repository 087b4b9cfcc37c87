"""`schedc run` for real: torchrun, traces, memory, communication volume, failures.

The traces come from the CLI under torchrun, as a user would make them; the rest runs on
the session's pool of gloo ranks (tests/pool.py).
"""

from __future__ import annotations

import json

import pytest

from schedc.compiler import compile_file, compile_text
from schedc.ir.op import Op
from schedc.lang.resources import DEFAULT_SCHEDULE
from tests.exec.test_equivalence import DDP_CASES, FSDP_CASES, fsdp
from tests.goldens import REPO
from tests.oracle import assert_matches
from tests.pool import JobFailed
from tests.ranks import finish, python, start_ranks, torchrun

SCHEDULES = REPO / "schedules"


def spans(events: list[dict], rank: int) -> dict[tuple[int, str], tuple[float, float, dict]]:
    """(step, op) -> (start, end, event) for one rank's complete events."""
    out = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] == rank:
            out[(e["args"]["step"], e["name"])] = (e["ts"], e["ts"] + e["dur"], e)
    return out


def overlap(a: tuple[float, float, dict], b: tuple[float, float, dict]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


# -- traces ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[str, list[dict]]:
    """The README's main command, `schedc run --trace`: the bundled default schedule
    (tiny_ddp_overlap, 40 steps) on 2 CPU ranks; its stdout and trace events."""
    trace = tmp_path_factory.mktemp("main") / "run.json"
    r = torchrun(2, "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(trace.read_text())["traceEvents"]


def step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


@pytest.mark.xdist_group("main_run")  # one run for the tests that read it
def test_ddp_trace_shows_bucket_1_launched_during_backward(main_run):
    assert DEFAULT_SCHEDULE == "tiny_ddp_overlap.sched"  # the main run's schedule
    _, events = main_run
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert names == {(r, t) for r in (0, 1) for t in ("compute", "comm", "steps")}
    # one name per op on every rank: the same (step, IR text) spans on both, each parsing back
    ops = [
        {k for k, v in spans(events, r).items() if not v[2]["name"].startswith("step ")}
        for r in (0, 1)
    ]
    assert ops[0] == ops[1] and len(ops[0]) > 3 * 20
    assert all(str(Op.parse(name)) == name for _, name in ops[0])
    for rank in (0, 1):
        s = spans(events, rank)
        for step in range(3):
            b1 = s[(step, "allreduce[b1]@mb3")]
            last_bwd = s[(step, "bwd[embed]@mb3")]
            # seed 003: bucket 1 goes out while backward still has layers to run
            assert b1[2]["args"]["launch_us"] < last_bwd[1]
            assert b1[2]["args"]["launch_us"] < s[(step, "bwd[h.1]@mb3")][0]
            b2 = s[(step, "allreduce[b2]@mb3")]
            assert b2[2]["args"]["launch_us"] >= last_bwd[1]  # exposed: nothing left
            assert s[(step, "optimizer.step")][0] >= b2[1]


def test_fsdp_trace_shows_prefetch_overlapping_compute(tmp_path):
    trace = tmp_path / "fsdp.json"
    r = torchrun(
        2, str(SCHEDULES / "tiny_fsdp_prefetch.sched"), "--steps", "3", "--trace", str(trace)
    )
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        s = spans(events, rank)
        fwd_hits = bwd_hits = 0
        for step in range(3):
            for mb in range(2):
                # forward: u2's gather runs while u1 (embed, h.0) computes
                ag_u2 = s[(step, f"allgather[u2]@mb{mb}:fwd")]
                fwd_u1 = [s[(step, f"fwd[{x}]@mb{mb}")] for x in ("embed", "h.0")]
                fwd_hits += any(overlap(ag_u2, f) > 0 for f in fwd_u1)
                assert ag_u2[2]["args"]["launch_us"] < fwd_u1[-1][1]
                # backward: u2's gather again runs while u3 (head, h.3) computes
                ag_u2b = s[(step, f"allgather[u2]@mb{mb}:bwd")]
                bwd_u3 = [s[(step, f"bwd[{x}]@mb{mb}")] for x in ("head", "h.3")]
                bwd_hits += any(overlap(ag_u2b, b) > 0 for b in bwd_u3)
                assert ag_u2b[2]["args"]["launch_us"] < bwd_u3[-1][1]
        assert fwd_hits > 0 and bwd_hits > 0, (rank, fwd_hits, bwd_hits)


@pytest.mark.xdist_group("main_run")
def test_main_command_trains_and_writes_a_trace(main_run):
    """The README's main job: the bundled default schedule on 2 CPU ranks; loss falls."""
    out, events = main_run
    losses = [float(line.split("loss ")[1].split()[0]) for line in step_lines(out)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses
    assert events


@pytest.mark.xdist_group("main_run")
def test_probe_times_every_collective_kind_for_calibrate(tmp_path, main_run):
    """`--probe`: a DDP schedule's trace also times all-gathers and reduce-scatters (on every
    rank, at each size, twice) and its layers at micro 1, and calibrate fits from them; the
    probe's own model leaves the run's numbers as they are (step 0's loss, lr and norm are
    the main run's: none of them depends on how many steps follow)."""
    from schedc.exec.probe import COMPUTE_LAYERS, REPS

    trace = tmp_path / "run.json"
    r = torchrun(2, "--steps", "1", "--trace", str(trace), "--probe")
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    probe = [e for e in events if e.get("cat") == "probe"]
    comm = [e for e in probe if "bytes" in e["args"]]
    kinds = {(e["pid"], e["args"]["kind"], e["args"]["bytes"]) for e in comm}
    assert len(comm) == 2 * 3 * 3 * 2 and len(kinds) == 2 * 3 * 3  # ranks, kinds, sizes, reps
    layers = {(e["args"]["kind"], e["args"]["layer"]) for e in probe if "layer" in e["args"]}
    assert layers == {(k, x) for k in ("fwd", "bwd") for x in COMPUTE_LAYERS}
    micros = {e["args"]["micro"] for e in probe if "micro" in e["args"]}
    assert 1 in micros and len(micros) == 2
    assert len(probe) - len(comm) == 2 * len(COMPUTE_LAYERS) * 2 * 2 * REPS  # ranks, fwd/bwd

    def numbers(line: str) -> str:  # `loss X | lr Y | norm Z`, without step i/N and times
        return line.split(" | dt ")[0].split(" | ", 1)[1]

    (probed,) = step_lines(r.stdout)
    assert numbers(probed) == numbers(step_lines(main_run[0])[0])
    fit = python("-m", "schedc", "calibrate", str(trace))
    assert fit.returncode == 0, fit.stderr
    assert "allgather: fitted to the probe's 3 sizes" in fit.stdout
    assert "reducescatter: fitted to the probe's 3 sizes" in fit.stdout
    assert f"compute: with the probe's {2 * len(COMPUTE_LAYERS) * 2} layer timings" in fit.stdout


def test_probe_without_a_trace_is_refused():
    r = python("-m", "schedc", "run", "--probe")
    assert r.returncode != 0 and "--probe times collectives and layers for the trace" in r.stderr
    assert "Traceback" not in r.stderr


# -- memory and communication ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_memory_matches_prediction_and_shards_scale(pool, world):
    text = fsdp(
        world,
        1,
        "unit tied = wte.weight keep\n  unit u1 = wpe.weight, h.0\n"
        "  unit u2 = h.1\n  unit u3 = head",
        micro=2,
    )
    predicted = compile_text(text).memory
    res = pool.run(text, world, steps=2)
    for measured in res.memory:
        # states after a step: shard, gradient shard, Adam m and v, all real tensors
        assert abs(measured["states"] - predicted.states) <= 0.10 * predicted.states
        assert abs(measured["gathered_peak"] - predicted.gathered_peak) <= (
            0.10 * predicted.gathered_peak
        )


def test_fsdp_sharded_state_scales_as_one_over_world():
    states = {}
    for world in (1, 2, 4):
        text = fsdp(
            world,
            1,
            "unit tied = wte.weight keep\n  unit u1 = wpe.weight, h.0\n"
            "  unit u2 = h.1\n  unit u3 = head",
            micro=2,
        )
        states[world] = compile_text(text).memory.states
    for world in (2, 4):
        assert abs(states[world] * world - states[1]) <= 0.01 * states[1], states


def test_fsdp_communicates_three_times_each_unit(pool):
    """Seed 004: per unit per step, AG (fwd) + AG (bwd) + RS = 3 x the unit's parameters."""
    text = fsdp(
        2,
        1,
        "unit tied = wte.weight keep\n  unit u1 = wpe.weight, h.0\n"
        "  unit u2 = h.1\n  unit u3 = head",
    )
    spec = compile_text(text).spec
    res = pool.run(text, 2, steps=1)
    for counted in res.comm_bytes:
        for u in spec.strategy.units:
            unit_bytes = -(-sum(spec.model.param(p).numel for p in u.params) // 2) * 2 * 4
            gathers = counted[f"allgather[{u.name}]"]
            scatters = counted[f"reducescatter[{u.name}]"]
            if u.keep:  # gathered once for the whole step, then reduce-scattered
                assert (gathers, scatters) == (unit_bytes, unit_bytes)
            else:
                assert (gathers, scatters) == (2 * unit_bytes, unit_bytes)
                assert gathers + scatters == 3 * unit_bytes


def test_ddp_communicates_each_bucket_once_per_step_with_no_sync(pool):
    text = DDP_CASES["w2-two-buckets-k2"]
    res = pool.run(text, 2, steps=1)
    spec = compile_text(text).spec
    for counted in res.comm_bytes:
        assert counted == {f"allreduce[{b.name}]": b.nbytes for b in spec.strategy.buckets}


@pytest.mark.parametrize(
    "text", [DDP_CASES["w2-two-buckets-k2"], FSDP_CASES["w2-three-units-p1-k2"]]
)
def test_measured_traffic_is_the_checkers_prediction(pool, text):
    """ir/sizes.op_bytes, summed over a rank's plan, is what the executor counts."""
    from schedc.ir.sizes import op_bytes

    c = compile_text(text)
    res = pool.run(text, c.spec.world, steps=1)
    for rank, counted in enumerate(res.comm_bytes):
        predicted: dict[str, int] = {}
        for op in c.plan(rank).ops:
            if op.is_collective:
                key = f"{op.kind.value}[{op.target}]"
                predicted[key] = predicted.get(key, 0) + op_bytes(c.spec, op)
        assert counted == predicted, rank


# -- faults are caught -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault,text",
    [
        ("skip-accum-scale", DDP_CASES["w2-two-buckets-k2"]),
        ("skip-accum-scale", FSDP_CASES["w2-three-units-p1-k2"]),
        ("reduce-first-micro-step", DDP_CASES["w2-two-buckets-k2"]),
    ],
)
def test_a_wrong_executor_is_caught(pool, reference, fault, text):
    result = pool.run(text, 2, steps=1, fault=fault)  # runs to the end, computing garbage
    with pytest.raises(AssertionError):
        assert_matches(result, reference(text, 1))


def test_a_failing_instruction_shows_the_plan(pool):
    with pytest.raises(JobFailed) as e:
        pool.run(DDP_CASES["w2-two-buckets-k2"], 2, steps=1, fault="fail-at bwd[h.0]@mb1")
    msg = str(e.value)
    assert "instruction" in msg and "bwd[h.0]@mb1" in msg and "<-- ERROR HERE" in msg


# -- refusing to start -----------------------------------------------------------------------------


def test_world_mismatch_of_a_job_started_otherwise_is_a_clear_error():
    """`schedc run FILE` starts the file's world itself (tests/exec/test_launcher.py); a job
    started by other means with another world size is refused in one line saying so."""
    job = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    sched = str(SCHEDULES / "tiny_ddp_overlap.sched")
    r = python("-m", "schedc", "run", sched, env=job, timeout=120)
    assert r.returncode == 1
    assert "world-2 schedule, but this job has 1 rank" in r.stderr
    assert f"`schedc run {sched}` starts its 2 ranks itself" in r.stderr
    assert "Traceback" not in r.stderr


def test_world_mismatch_under_torchrun_fails_every_rank():
    r = torchrun(2, str(SCHEDULES / "tiny_4gpu.sched"), timeout=120)
    assert r.returncode != 0
    # each rank that reaches the check says it on its own line (torchrun's report quotes
    # them again); torchrun may SIGTERM the second rank once the first has failed, before it
    # prints (seen in CI), so at least one rank, and every line the same error
    own = [ln for ln in r.stderr.splitlines() if ln.startswith("schedc: error on rank")]
    ranks = {ln[: len("schedc: error on rank 0")] for ln in own}
    assert ranks and ranks <= {"schedc: error on rank 0", "schedc: error on rank 1"}, own
    assert all("world-4 schedule, but this job has 2 ranks" in ln for ln in own)


def test_ranks_with_different_schedules_refuse_to_start(tmp_path):
    """Each rank is given another file: both stop before step 1, neither hangs."""
    other = tmp_path / "other.sched"
    other.write_text(
        (SCHEDULES / "tiny_ddp_overlap.sched")
        .read_text()
        .replace("bucket b1 = head, h.3 .. h.2", "bucket b1 = head, h.3")
        .replace("bucket b2 = h.1 .. h.0, embed", "bucket b2 = h.2 .. h.0, embed")
    )
    files = [SCHEDULES / "tiny_ddp_overlap.sched", other]
    for code, out, err in finish(start_ranks([[str(f), "--timeout", "60"] for f in files]), 120):
        assert code == 1, err
        assert "ranks disagree before step 1" in err
        assert "step    0" not in out


def test_every_bundled_tiny_schedule_runs_one_step(pool, reference):
    for f in sorted(SCHEDULES.glob("tiny_*.sched")):
        c = compile_file(f)
        res = pool.run(c.source.text, c.spec.world, steps=1)
        assert_matches(res, reference(c.source.text, 1))


def test_mfu_on_a_gpu_is_palms_estimate_over_the_devices_peak(monkeypatch):
    import torch

    from schedc.exec.report import mfu

    spec = compile_file(SCHEDULES / "gpt2_8gpu.sched").spec
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    per_token = 6 * 124_439_808 + 12 * 12 * 768 * 1024
    got = mfu(spec, 1e6, torch.device("cuda", 0))
    assert abs(got - per_token * 1e6 / (989e12 * 8)) < 1e-12
    assert mfu(spec, 1e6, torch.device("cpu")) is None
