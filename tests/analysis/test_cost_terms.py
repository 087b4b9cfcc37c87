"""The cost model's terms and their fit: `schedc calibrate` recovers the compute rate,
bandwidth, latency and memory bandwidth from a trace made from known values, and the CPU
terms (issue 18) too: a per-op overhead, a backward's gradient bytes, per-kind collective
rates and the optimizer's bytes; a params.json from before them still loads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from schedc.analysis.calibrate import calibrate
from schedc.analysis.cost import CostModel, duration, grad_bytes, norm_per_param, optimizer_bytes
from schedc.analysis.least_squares import nnls
from schedc.analysis.simulate import simulate
from schedc.analysis.trace.read import validate
from schedc.analysis.trace.stream import load
from schedc.analysis.trace.write import chrome_trace
from schedc.compiler import compile_file
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Strategy
from tests.goldens import REPO


def traced(timeline):
    """A simulated timeline as `schedc run --trace` would have traced it, read back."""
    return validate(chrome_trace(timeline), "trace")


TRUE = CostModel(
    flops=42e9,
    bandwidth=1.2e9,
    latency=4e-3,
    mem_bandwidth=3.5e9,
    norm_bandwidth=3.5e9,  # calibrate fits the two as one memory speed
    free=2e-5,
    overhead=3e-4,
    grad_bandwidth=1.4e9,
    gather_bandwidth=2.7e8,
    gather_latency=1.5e-3,
    scatter_bandwidth=2.1e8,
    scatter_latency=0.5e-3,
)


def sched(name: str):
    return compile_file(REPO / "schedules" / f"{name}.sched")


@pytest.mark.parametrize("name", ["ddp_overlap", "fsdp_prefetch", "gpt2_8gpu"])
def test_calibrate_recovers_a_synthetic_trace(name):
    c = sched(name)
    # the optimizer step's norm and AdamW at one memory speed, as calibrate fits them
    true = CostModel(
        flops=42e12,
        bandwidth=17e9,
        latency=33e-6,
        mem_bandwidth=0.9e12,
        norm_bandwidth=0.9e12,
        free=3e-6,
    )
    fit = calibrate(c, validate(chrome_trace(simulate(c, true)), "t"))
    assert fit.cost.flops is None  # the fitted rate is the schedule's compute dtype's
    assert fit.compute_key == CostModel().rate_key(c.spec.numerics)
    assert getattr(fit.cost, fit.compute_key) == pytest.approx(42e12, rel=1e-6)
    for field in ("bandwidth", "latency", "mem_bandwidth", "norm_bandwidth"):
        assert getattr(fit.cost, field) == pytest.approx(getattr(true, field), rel=1e-6), field
    assert fit.compute_rms < 1e-9 and fit.comm_rms < 1e-9


@pytest.mark.parametrize("name", ["tiny_fsdp_prefetch", "gpt2_8gpu", "tiny_ddp_overlap"])
def test_calibrate_fits_every_term_back(name):
    c = sched(name)
    fit = calibrate(c, traced(simulate(c, TRUE)))
    got = fit.cost
    assert getattr(got, fit.compute_key) == pytest.approx(42e9, rel=1e-6)
    fsdp = c.spec.kind is Strategy.FSDP
    # an FSDP trace has no all-reduce: bandwidth and latency fit every collective together
    fields = ("overhead", "grad_bandwidth", "mem_bandwidth", "norm_bandwidth")
    for field in (*fields, "free") if fsdp else (*fields, "bandwidth", "latency"):
        want = getattr(TRUE, field)
        assert getattr(got, field) == pytest.approx(want, rel=1e-6, abs=1e-12), field
    if fsdp:
        for field in ("gather_bandwidth", "gather_latency", "scatter_bandwidth", "scatter_latency"):
            assert getattr(got, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    else:  # a DDP trace has no all-gather: those keep the all-reduce's, and say so
        assert got.gather_bandwidth is None and got.scatter_bandwidth is None
        assert any("no allgather in the trace" in n for n in fit.notes)
    assert fit.compute_rms < 1e-9 and fit.comm_rms < 1e-9
    # the refitted model prices the step as the true one did
    assert simulate(c, got).end == pytest.approx(simulate(c, TRUE).end, rel=1e-6)
    assert "per fwd/bwd op" in fit.report() and "1.4 GB/s" in fit.report()


def test_a_flops_only_trace_fits_no_extra_terms():
    """A trace the old model explains (FLOPs only) fits overhead 0 and no gradient term:
    the non-negative least squares drops the columns it does not need."""
    c = sched("tiny_ddp_overlap")
    true = CostModel(flops=80e12, bandwidth=40e9, latency=20e-6)
    fit = calibrate(c, traced(simulate(c, true)))
    assert fit.cost.flops_tf32 == pytest.approx(80e12, rel=1e-6)
    assert fit.cost.overhead == pytest.approx(0, abs=1e-15)
    assert fit.cost.grad_bandwidth is None
    assert "no term" in fit.report()


def test_nnls_drops_a_column_whose_best_value_is_negative():
    rows = [(1.0, 1.0, 1.0), (2.0, 0.0, 1.0), (3.0, 1.0, 1.0), (4.0, 0.0, 1.0)]
    ts = [2 * r[0] - 0.5 * r[1] + 0.1 for r in rows]  # the second column's coefficient < 0
    x = nnls(rows, ts, required=(0,))
    assert x[1] == 0 and x[0] > 0 and x[2] >= 0
    exact = nnls(rows, [2 * r[0] + 0.5 * r[1] + 0.1 for r in rows], required=(0,))
    assert exact == pytest.approx([2, 0.5, 0.1])


def test_the_terms_are_priced_from_shapes_and_bytes():
    c = sched("tiny_fsdp_prefetch")
    spec = c.spec
    embed, head = Op.parse("bwd[embed]@mb0"), Op.parse("bwd[head]@mb0")
    cfg = spec.model
    C, V = cfg.n_embd, cfg.vocab_size
    # the head's backward writes the tied weight's whole gradient (and ln_f's); the
    # embedding's adds its tokens' rows into .grad in place: only wpe's is dense
    assert grad_bytes(spec, head) == 4 * (V * C + 2 * C)
    assert grad_bytes(spec, embed) == 4 * cfg.block_size * C
    compiled = replace(spec, numerics=replace(spec.numerics, compile=True))
    assert grad_bytes(compiled, embed) == 4 * (V + cfg.block_size) * C  # a dense table again
    assert grad_bytes(spec, Op.parse("fwd[embed]@mb0")) == 0
    plain = CostModel(flops=1e12)
    assert duration(spec, head, TRUE) - duration(spec, head, plain) > grad_bytes(
        spec, head
    ) / TRUE.grad_bandwidth * (1 - 1e-9)
    gather = next(op for op in c.plan().ops if op.kind is Kind.ALLGATHER)
    slow = CostModel(gather_bandwidth=1e9, gather_latency=0.0)
    assert duration(spec, gather, slow) > duration(spec, gather, CostModel())
    # FSDP's norm runs in float64: more bytes per parameter than DDP's, on its shards (half)
    fsdp, ddp = norm_per_param(Strategy.FSDP, 1.0), norm_per_param(Strategy.DDP, 1.0)
    assert fsdp == 8 + 36 and ddp == 8 + 4
    assert optimizer_bytes(spec, norm=True) == pytest.approx((28 + fsdp) * cfg.numel / 2, rel=1e-3)
    assert optimizer_bytes(sched("tiny_ddp_overlap").spec, norm=True) == (28 + ddp) * cfg.numel
    # unset (the default, a GPU) the norm is not priced: the step is AdamW's bytes alone
    step = Op.parse("optimizer.step")
    assert duration(spec, step, CostModel()) == optimizer_bytes(spec) / CostModel().mem_bandwidth


def test_an_old_params_file_loads_and_a_bad_term_is_named(tmp_path):
    old = tmp_path / "old.json"  # written before the CPU terms
    old.write_text(json.dumps({"flops_tf32": 6.9e10, "bandwidth": 1.5e9, "latency": 0.0096}))
    cost = CostModel.load(old)
    assert cost.overhead == 0 and cost.grad_bandwidth is None and cost.gather_bandwidth is None
    assert cost.link_of(Kind.ALLGATHER) == (0.0096, 1.5e9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"grad_bandwidth": 0}))
    with pytest.raises(ValueError, match="grad_bandwidth"):
        CostModel.load(bad)
    fitted = tmp_path / "new.json"
    fitted.write_text(TRUE.to_json())
    assert CostModel.load(fitted) == TRUE


def test_merged_fits_take_each_parameter_from_the_trace_that_measured_it(tmp_path):
    """A DDP trace measures the all-reduce, an FSDP trace the all-gather and reduce-scatter;
    `tune --measure`'s refit merges them without the FSDP trace's stand-in bandwidth (its
    collectives fitted together) pulling the all-reduce's."""
    from schedc.tune.measure import Run, refit

    runs = []
    for name in ("tiny_ddp_overlap", "tiny_fsdp_prefetch"):
        path = REPO / "schedules" / f"{name}.sched"
        trace = tmp_path / f"{name}.json"
        tl = simulate(compile_file(path), TRUE)
        trace.write_text(json.dumps(chrome_trace(tl, path=str(path))))
        runs.append(Run(path, trace, tmp_path / f"{name}.log"))
    # a third trace whose fit drops the gradient term (grad_bandwidth None) has no say on it
    path = REPO / "schedules" / "ddp_overlap.sched"
    plain = simulate(compile_file(path), replace(TRUE, grad_bandwidth=None, overhead=0.0))
    (tmp_path / "plain.json").write_text(json.dumps(chrome_trace(plain, path=str(path))))
    runs.append(Run(path, tmp_path / "plain.json", tmp_path / "plain.log"))
    merged, notes = refit(runs, CostModel())
    assert not notes
    assert merged.grad_bandwidth == pytest.approx(TRUE.grad_bandwidth, rel=1e-6)
    for field in ("bandwidth", "latency", "gather_bandwidth", "scatter_latency"):
        assert getattr(merged, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    alone = calibrate(compile_file(runs[1].file), load(runs[1].trace))
    assert "bandwidth" not in alone.measured and "gather_bandwidth" in alone.measured
    assert alone.cost.bandwidth != pytest.approx(TRUE.bandwidth, rel=1e-3)  # the stand-in


def probe_events(true: CostModel, ranks: int = 2, skew: float = 2e-3) -> list[dict]:
    """exec/probe.py's events as a link priced by `true` would time them: every kind at its
    three sizes, twice, rank 1 arriving `skew` late (the time counts from the last arrival)."""
    from schedc.exec.probe import KINDS, REPS, SIZES  # the layout the executor writes

    events, t = [], 1.0
    for kind in KINDS:
        lat, bw = true.link_of(Kind(kind))
        factor = 2 * (ranks - 1) / ranks if kind == "allreduce" else (ranks - 1) / ranks
        for size in SIZES:
            for rep in range(REPS):
                dur = lat + factor * size / bw
                for rank in range(ranks):
                    start = t + rank * skew
                    events.append(
                        {
                            "name": f"probe {kind} {size}",
                            "ph": "X",
                            "pid": rank,
                            "tid": 9,
                            "ts": start * 1e6,
                            "dur": (t + (ranks - 1) * skew + dur - start) * 1e6,
                            "cat": "probe",
                            "args": {"kind": kind, "bytes": size, "ranks": ranks, "rep": rep},
                        }
                    )
                t += 1.0
    return events


@pytest.mark.torch
def test_the_probe_prices_the_kind_the_schedule_never_runs():
    """An FSDP trace has no all-reduce; with `schedc run --probe`'s timings in it, calibrate
    fits the all-reduce's own bandwidth and latency from them (and the gathers and
    reduce-scatters still from the schedule's ops, which the probe does not override)."""
    c = sched("tiny_fsdp_prefetch")
    trace = chrome_trace(simulate(c, TRUE))
    other = replace(TRUE, gather_bandwidth=9e8, scatter_bandwidth=8e8)  # not the ops' rates
    trace["traceEvents"] += probe_events(other)
    fit = calibrate(c, validate(trace, "trace"))
    assert fit.cost.bandwidth == pytest.approx(TRUE.bandwidth, rel=1e-6)
    assert fit.cost.latency == pytest.approx(TRUE.latency, rel=1e-6)
    assert fit.cost.gather_bandwidth == pytest.approx(TRUE.gather_bandwidth, rel=1e-6)
    assert fit.cost.scatter_bandwidth == pytest.approx(TRUE.scatter_bandwidth, rel=1e-6)
    assert "allreduce: fitted to the probe's 3 sizes" in fit.notes
    assert {"bandwidth", "latency"} <= fit.measured
    without = calibrate(c, traced(simulate(c, TRUE)))  # no probe: every kind together
    assert without.cost.bandwidth != pytest.approx(TRUE.bandwidth, rel=1e-3)


def test_a_malformed_probe_event_is_named():
    from schedc.analysis.probes import probes
    from schedc.analysis.trace.schema import TraceError

    bad = {"traceEvents": [{"ph": "X", "cat": "probe", "ts": 1, "dur": 1, "args": {"kind": "x"}}]}
    with pytest.raises(TraceError, match=r"traceEvents\[0\]\.args: a probe needs kind"):
        probes(validate(bad, "trace"))


def compute_probe_events(c, true: CostModel, ranks: int = 2) -> list[dict]:
    """exec/probe.py's layer timings as `true` prices them, at micro 1 and the schedule's."""
    from schedc.analysis.cost import compute_time, op_flops
    from schedc.exec.probe import COMPUTE_LAYERS, REPS, probe_micros

    spec, events, t = c.spec, [], 1.0
    rate = true.rate(spec.numerics)
    for m in probe_micros(spec.micro):
        for layer in COMPUTE_LAYERS:
            for kind in ("fwd", "bwd"):
                op = Op(Kind(kind), layer)
                dur = compute_time(op_flops(spec, op, m), grad_bytes(spec, op), rate, true)
                for rep in range(REPS):
                    for rank in range(ranks):
                        args = {"kind": kind, "layer": layer, "micro": m, "tokens": 0, "rep": rep}
                        events.append(
                            {
                                "name": f"probe {kind}[{layer}] micro {m}",
                                "ph": "X",
                                "pid": rank,
                                "tid": 9,
                                "ts": t * 1e6,
                                "dur": dur * 1e6,
                                "cat": "probe",
                                "args": args,
                            }
                        )
                    t += 1.0
    return events


@pytest.mark.torch
def test_the_compute_probe_sets_apart_a_micro_steps_cost_from_a_tokens():
    """At one micro size a linear layer's FLOPs and the gradient bytes its backward writes
    are in a fixed ratio, so a step's ops barely tell a per-call cost from a per-token one;
    the probe's layer timings at micro 1, priced by the same true model, join the fit's
    points, and the fit recovers every compute term."""
    c = sched("tiny_ddp_overlap")
    trace = chrome_trace(simulate(c, TRUE))
    trace["traceEvents"] += compute_probe_events(c, TRUE)
    fit = calibrate(c, validate(trace, "trace"))
    assert fit.cost.flops_tf32 == pytest.approx(TRUE.flops, rel=1e-6)
    assert fit.cost.grad_bandwidth == pytest.approx(TRUE.grad_bandwidth, rel=1e-6)
    assert fit.cost.overhead == pytest.approx(TRUE.overhead, rel=1e-6)
    assert any("compute: with the probe's 12 layer timings at micro 1, 2" in n for n in fit.notes)
    alone = calibrate(c, traced(simulate(c, TRUE)))
    assert fit.compute_n == alone.compute_n + 12  # the schedule's distinct ops, the probe's


@pytest.mark.torch  # the probe's layout comes from exec/probe.py
def test_a_compute_probe_of_another_model_or_malformed_is_named():
    from schedc.analysis.probes import compute_probes
    from schedc.analysis.trace.schema import TraceError

    c = sched("tiny_ddp_overlap")
    trace = chrome_trace(simulate(c, TRUE))
    bad = compute_probe_events(c, TRUE)[:1]
    bad[0]["args"] = dict(bad[0]["args"], layer="h.99")
    with pytest.raises(TraceError, match="the probe timed layer 'h.99'"):
        calibrate(c, validate({"traceEvents": trace["traceEvents"] + bad}, "trace"))
    broken = {"traceEvents": [dict(bad[0], args={"kind": "fwd", "layer": "h.0"})]}
    with pytest.raises(TraceError, match=r"traceEvents\[0\]\.args: a compute probe needs"):
        compute_probes(validate(broken, "trace"))
