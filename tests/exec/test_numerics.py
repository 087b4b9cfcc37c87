"""Precision policies run as the schedule says (issue #13): fixed cases on real gloo ranks.

Each DDP and FSDP schedule below runs at worlds 1 and 2 under every policy its strategy has
(bf16 compute; bf16 gather, FSDP; bf16 reduce) and must equal the single-process reference
run under the same policy, within tests/oracle.py's tolerance for it. The collectives must
move the dtype the policy names (a bf16 gather or reduction moves half the bytes of an fp32
one), and the model states must stay fp32 whatever is computed or communicated in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.exec.test_equivalence import THREE_UNITS, TWO_BUCKETS, ddp, fsdp
from tests.oracle import assert_matches

POLICIES = {
    "fp32": "",
    "bf16-compute": "precision { compute = bf16 }",
    "bf16-gather": "precision bf16",  # compute and gathers bf16, reductions fp32
    "bf16-reduce-ddp": "precision { compute = bf16  reduce = bf16 }",
    "bf16-reduce-fsdp": "precision bf16 { reduce = bf16 }",  # everything communicated bf16
}


def with_policy(text: str, policy: str) -> str:
    return text + POLICIES[policy] + "\n"


def DDP(world: int, policy: str) -> str:
    return with_policy(ddp(world, 2, TWO_BUCKETS), policy)


def FSDP(world: int, policy: str, **kw) -> str:
    return with_policy(fsdp(world, 2, THREE_UNITS, **kw), policy)


CASES = {
    f"{kind}-w{w}-{p}": (DDP(w, p) if kind == "ddp" else FSDP(w, p), w)
    for w in (1, 2)
    for kind, policies in (
        ("ddp", ("bf16-compute", "bf16-reduce-ddp")),
        ("fsdp", ("bf16-compute", "bf16-gather", "bf16-reduce-fsdp")),
    )
    for p in policies
}
CASES["fsdp-w2-bf16-gather-no-sync"] = (FSDP(2, "bf16-gather", no_sync=True), 2)


@pytest.mark.parametrize("text,world", CASES.values(), ids=CASES.keys())
def test_each_policy_equals_the_reference_under_it(pool, reference, text, world):
    result = pool.run(text, world, steps=2)
    ref = reference(text, 2)
    assert ref.policy != "float32"  # the reference ran the policy, and so is held to it
    assert_matches(result, ref)
    for step in result.steps:  # what the optimizer read and wrote: fp32 whatever the policy
        assert {g.dtype for g in step.grads.values()} == {torch.float32}
        assert {p.dtype for p in step.params.values()} == {torch.float32}


@pytest.mark.parametrize("no_sync", [False, True], ids=["per-micro-step", "no-sync"])
def test_world_1_fsdp_under_bf16_is_bitwise_the_reference(pool, reference, no_sync):
    """One rank, the reference's micro-batch: the same bf16 kernels on the same bf16 weights
    in the same order, and each micro-step's gradient added into fp32 as the reference adds
    it, so the first step's gradients are equal to the bit (measured: also the second's).
    Under no_sync too: the micro-steps accumulate in the fp32 reduce dtype (FSDP2's upcast;
    summed in bf16 they were 0.37% of ln_f.bias's largest gradient off)."""
    text = FSDP(1, "bf16-gather", no_sync=no_sync)
    got, want = pool.run(text, 1, steps=1).steps[0], reference(text, 1)[0]
    for name, w in want.grads.items():
        assert torch.equal(got.grads[name], w), name
    assert got.loss == want.loss


def _bytes(result, rank: int = 0) -> dict[str, int]:
    return result.comm_bytes[rank]


def test_bf16_gathers_and_reductions_move_half_the_bytes(pool):
    fp32, gather, both = (
        pool.run(FSDP(2, p), 2) for p in ("bf16-compute", "bf16-gather", "bf16-reduce-fsdp")
    )
    a, g, b = _bytes(fp32), _bytes(gather), _bytes(both)
    assert a.keys() == g.keys() == b.keys()
    for key in a:
        if key.startswith("allgather"):
            assert g[key] * 2 == a[key] and b[key] * 2 == a[key], key
        else:  # reduce-scatters: fp32 unless the policy reduces in bf16
            assert key.startswith("reducescatter")
            assert g[key] == a[key] and b[key] * 2 == a[key], key
    d32, d16 = (
        _bytes(pool.run(DDP(2, "bf16-compute"), 2)),
        _bytes(pool.run(DDP(2, "bf16-reduce-ddp"), 2)),
    )
    assert d32.keys() == d16.keys() and all(d16[k] * 2 == d32[k] for k in d32), (d32, d16)


def test_master_weights_and_adamw_moments_stay_fp32(pool):
    """The model states each rank holds at the update (shard, gradient shard, Adam m and v:
    4 tensors of fp32 for every element of the shard) are the same bytes under a bf16
    gather and reduction as under fp32, while the gathered units take half."""
    fp32, low = pool.run(FSDP(2, "fp32"), 2), pool.run(FSDP(2, "bf16-reduce-fsdp"), 2)
    for m32, m16 in zip(fp32.memory, low.memory):
        assert m16["states"] == m32["states"] > 0
        assert m16["gathered_peak"] * 2 == m32["gathered_peak"]
        assert m16["grads_peak"] * 2 == m32["grads_peak"]  # unsharded gradients: bf16
    shards = sum(p.numel() for p in fp32.steps[0].params.values())  # unpadded, whole model
    assert sum(m["states"] for m in low.memory) >= 16 * shards  # 4 bytes x 4 per element


# -- bf16 under FSDP: autocast on top of the gathered bf16 weights -------------------------------

BF16_SHAPES = {
    "single": "model nano\nworld 1\nbatch 4 x 32\nmicro 2\nseed 7\nprecision bf16\n",
    "fsdp": FSDP(1, "bf16-gather"),
}


@pytest.mark.parametrize("shape", BF16_SHAPES)
def test_bf16_under_fsdp_is_autocast_on_bf16_weights(world1, shape):
    """The decision docs/language.md records: `precision bf16` autocasts in every shape; FSDP
    also gathers the weights in bf16 (FSDP2's param_dtype), so its residual stream, which
    starts at the gathered embedding tables, is bf16 where one process's is fp32. The
    matmuls are bf16 and the loss fp32 in both; an op autocast leaves alone follows its
    inputs (on a CPU LayerNorm: bf16 under FSDP; CUDA's autocast runs it in fp32)."""
    from tests.world1 import executor

    ex = executor(BF16_SHAPES[shape], steps=1)
    seen: dict[str, torch.dtype] = {}

    def saw(name: str, which: int):
        def hook(module, *io):  # returns None: the hook changes nothing
            seen.setdefault(name, io[which][0].dtype if which == 0 else io[which].dtype)

        return hook

    block = ex.model.h[0]
    hooks = [
        block.register_forward_pre_hook(saw("residual", 0)),
        block.ln_1.register_forward_hook(saw("ln_1", 1)),
        block.attn.c_attn.register_forward_hook(saw("matmul", 1)),
    ]
    stats = ex.step()
    for h in hooks:
        h.remove()
    ex.close()
    residual = torch.bfloat16 if shape == "fsdp" else torch.float32
    assert seen == {
        "residual": residual,
        "ln_1": residual,  # CPU autocast leaves layer_norm to its inputs
        "matmul": torch.bfloat16,
    }
    assert ex.micro[0].loss.dtype == torch.float32 and math.isfinite(stats.loss)
