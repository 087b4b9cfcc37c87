"""The memory ledger and the traffic per collective, per dtype (issue 13).

Every buffer is counted in its real dtype (passes/memory.py's docstring is the contract
the executor allocates by): the fp32 model states never change with the policy, the
gathered units and unsharded gradients are in the gather dtype, and each collective's
temporaries (casts, reduce-scatter outputs) in its own dtype. The expected figures here
are computed from the units' sizes, the way that docstring states them, not read back
from the ledger.
"""

from __future__ import annotations

import pytest

from schedc.compiler import compile_text
from schedc.ir.op import Kind
from schedc.ir.sizes import op_bytes, padded, unit_numel
from schedc.passes.memory import predict

FSDP = """model nano
world 2
batch 8 x 32
micro 2             # k = 2: a unit's second reduce-scatter lands in a temporary
{precision}
fsdp {{
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = h.1
  unit u3 = head
}}
"""

DDP = """model nano
world 2
batch 8 x 32
micro 2
{precision}
ddp {{
  bucket b1 = head, h.1
  bucket b2 = h.0, embed
}}
"""

POLICIES = {
    "fp32": "",
    "bf16": "precision bf16",  # compute and gather bf16, reduce fp32
    "bf16-reduce": "precision bf16 { reduce = bf16 }",
    "fp32-gather": "precision { compute = bf16  gather = fp32  reduce = bf16 }",
}


def compiled(text: str, policy: str):
    return compile_text(text.format(precision=POLICIES[policy]))


def sizes(c) -> dict[str, int]:
    """Each unit's padded length P."""
    spec = c.spec
    return {u.name: padded(unit_numel(spec, u), spec.world) for u in spec.strategy.units}


def test_the_plan_does_not_depend_on_the_policy():
    """So every comparison below is of the same plan, counted in other dtypes."""
    plans = {p: [str(op) for op in compiled(FSDP, p).plan().ops] for p in POLICIES}
    assert all(ops == plans["fp32"] for ops in plans.values())


def test_a_bf16_gather_halves_the_gathered_units_and_their_gradients():
    fp32, bf16 = (
        predict(c.spec, c.plan()) for c in (compiled(FSDP, "fp32"), compiled(FSDP, "bf16"))
    )
    assert bf16.gathered_peak * 2 == fp32.gathered_peak > 0
    assert bf16.grads_peak * 2 == fp32.grads_peak > 0
    assert bf16.states == fp32.states  # master weights, gradient shards, m, v: fp32 always
    P = sizes(compiled(FSDP, "fp32"))
    assert fp32.states == sum(16 * n // 2 for n in P.values())  # 16 bytes/param / D


# reduce-scatters on the compute stream: each is retired as it is issued, so the
# communication buffers at one op are that op's own
SERIAL = FSDP.replace("fsdp {{", "stream reducescatter = compute\nfsdp {{")


@pytest.mark.parametrize(
    "policy,expected",
    [
        # fp32: what it sends (gloo's copy of the gradient, P x 4) and, for a unit's second
        # reduce-scatter of the step, the output temporary S x 4
        ("fp32", lambda P: max(n * 4 + n // 2 * 4 for n in P.values())),
        # bf16 gradients reduced in fp32: the fp32 cast of the full gradient and gloo's copy
        # of it, 2 x P x 4, plus the fp32 output of a second reduce-scatter, S x 4 (the
        # first writes the gradient shard)
        ("bf16", lambda P: max(2 * n * 4 + n // 2 * 4 for n in P.values())),
        # bf16 gradients reduced in bf16: no input cast, gloo's copy P x 2, a bf16 output
        # shard S x 2 each time
        ("bf16-reduce", lambda P: max(n * 2 + n // 2 * 2 for n in P.values())),
        # fp32 gradients reduced in bf16: the bf16 input and gloo's copy, 2 x P x 2, and its
        # bf16 output S x 2
        ("fp32-gather", lambda P: max(2 * n * 2 + n // 2 * 2 for n in P.values())),
    ],
)
def test_reduce_buffers_follow_the_reduce_dtype(policy, expected):
    c = compile_text(SERIAL.format(precision=POLICIES[policy]))
    assert predict(c.spec, c.plan()).comm_peak == expected(sizes(c))


def test_a_reduce_scatter_holds_its_buffers_until_it_is_retired():
    """On the comm stream nothing waits for the reduce-scatters of the first micro-step
    until the second's forward gathers on that stream: their buffers add up."""
    c = compiled(FSDP, "fp32")
    serial = compile_text(SERIAL.format(precision=""))
    P = sizes(c)
    overlapped, one = predict(c.spec, c.plan()).comm_peak, predict(serial.spec, serial.plan())
    assert one.comm_peak == max(n * 4 + n // 2 * 4 for n in P.values())
    assert overlapped > one.comm_peak
    assert overlapped <= sum(n * 4 + n // 2 * 4 for n in P.values())


def test_the_peak_is_a_sum_of_the_parts_at_one_op():
    """Under a bf16 gather and reduce the temporaries are bf16 (an all-gather's cast
    shard, what a reduce-scatter sends and its output), and the peak is states held,
    gathered units, gradients and temporaries at one op: above the states, below the sum of
    the peaks."""
    c = compile_text(SERIAL.format(precision=POLICIES["bf16-reduce"]))
    m, P = predict(c.spec, c.plan()), sizes(c)
    assert m.comm_peak == max(n * 2 + n // 2 * 2 for n in P.values())
    assert m.states < m.buffers_peak <= m.states + m.gathered_peak + m.grads_peak + m.comm_peak
    assert m.peak_at and m.buffers_peak < m.peak <= m.buffers_peak + m.activations + m.states


@pytest.mark.parametrize("policy", ["fp32", "bf16", "bf16-reduce"])
def test_ddp_buckets_reduced_in_bf16_need_a_bf16_copy(policy):
    c = compiled(DDP, policy)
    spec, m = c.spec, predict(c.spec, c.plan())
    assert m.states == 16 * spec.model.numel  # the fp32 bucket is the gradient
    assert (m.gathered_peak, m.grads_peak) == (0, 0)
    copies = [sum(spec.model.param(p).numel for p in b.params) * 2 for b in spec.strategy.buckets]
    if policy == "bf16-reduce":
        assert (m.comm_peak, m.buffers_peak) == (max(copies), m.states + max(copies))
    else:  # reduced in fp32: in place, in the bucket
        assert (m.comm_peak, m.buffers_peak) == (0, m.states)


def test_traffic_per_collective_follows_the_gather_and_reduce_dtypes():
    for policy, (g, r) in {
        "fp32": (4, 4),
        "bf16": (2, 4),
        "bf16-reduce": (2, 2),
        "fp32-gather": (4, 2),
    }.items():
        c = compiled(FSDP, policy)
        P = sizes(c)
        for op in c.plan().ops:
            if op.kind is Kind.ALLGATHER:
                assert op_bytes(c.spec, op) == P[op.target] * g, (policy, op)
            elif op.kind is Kind.REDUCESCATTER:
                assert op_bytes(c.spec, op) == P[op.target] * r, (policy, op)
    for policy, r in {"fp32": 4, "bf16": 4, "bf16-reduce": 2}.items():
        c = compiled(DDP, policy)
        nbytes = {b.name: b.nbytes for b in c.spec.strategy.buckets}  # fp32 bytes
        for op in c.plan().ops:
            if op.kind is Kind.ALLREDUCE:
                assert op_bytes(c.spec, op) == nbytes[op.target] * r // 4, (policy, op)


def test_activations_follow_the_compute_dtype():
    """bf16 autocast saves the matmuls' inputs in bf16: less per token, never more."""
    fp32, bf16 = (compiled(FSDP, p) for p in ("fp32", "bf16"))
    a32 = predict(fp32.spec, fp32.plan()).activations
    a16 = predict(bf16.spec, bf16.plan()).activations
    assert 0 < a16 < a32


BUDGET = """model tiny
world 1
batch 16 x 128
micro 16
memory 150 MiB
{recompute}
"""


def test_over_budget_because_of_activations_and_recompute_fits():
    """Activations are the largest part of this peak: rejected naming them; recomputing
    every block brings the same schedule under the same budget."""
    from schedc.lang.diagnostics import CompileError

    with pytest.raises(CompileError) as e:
        compile_text(BUDGET.format(recompute=""))
    [d] = e.value.diagnostics
    assert d.code == "memory-budget"
    assert "the largest part is activations" in d.message and "recompute" in d.hint
    c = compile_text(BUDGET.format(recompute="recompute h.0 .. h.3"))
    plain = compile_text(BUDGET.format(recompute="").replace("memory 150 MiB", ""))
    assert c.memory.peak <= 150 << 20 < plain.memory.peak
    assert c.memory.activations < plain.memory.activations


def test_a_recompute_holds_one_layer_at_a_time():
    """With every block recomputed, the activations live at once are the kept inputs, the
    head's and one block's saved tensors (plus transients), not every block's."""
    from schedc.ir.sizes import layer_acts

    plain = compile_text(BUDGET.format(recompute="").replace("memory 150 MiB", ""))
    again = compile_text(
        BUDGET.format(recompute="recompute h.0 .. h.3").replace("memory 150 MiB", "")
    )
    spec = plain.spec
    block, head = layer_acts(spec, "h.0"), layer_acts(spec, "head")
    saved_all = 4 * block.saved + head.saved
    assert plain.memory.activations >= saved_all  # at the end of forward every block's is live
    assert again.memory.activations < 4 * block.kept + head.saved + block.saved + head.bwd + (
        block.bwd + head.fwd
    )
