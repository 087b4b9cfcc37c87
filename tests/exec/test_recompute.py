"""Recomputation changes nothing in the numbers: bitwise the same step.

A recomputing layer runs its forward without autograd, keeps its input, and runs the
forward again right before its backward. GPT-2's layers draw no random numbers (no
dropout: schedc/model/gpt2.py), and on the CPU the same kernels on the same values give
the same bits, so the gradients and the updated parameters must be *equal*, not close,
to those of the same schedule without `recompute`, fused or traced, DDP and FSDP.
(The generated cases of tests/exec/test_properties.py add the recompute axis against the
reference, within its tolerances.)
"""

from __future__ import annotations

import pytest
import torch

from tests.exec.test_equivalence import DDP_CASES, FSDP_CASES


def assert_bitwise(a, b) -> None:
    assert len(a.steps) == len(b.steps)
    for x, y in zip(a.steps, b.steps):
        assert x.loss == y.loss and x.grad_norm == y.grad_norm, (x.step, x.loss, y.loss)
        assert x.grads.keys() == y.grads.keys() and x.params.keys() == y.params.keys()
        for name in x.grads:
            assert torch.equal(x.grads[name], y.grads[name]), f"step {x.step}: grad {name}"
            assert torch.equal(x.params[name], y.params[name]), f"step {x.step}: param {name}"


CASES = {
    # text, world, the recompute statement
    "ddp-w2-all-blocks": (DDP_CASES["w2-two-buckets-k2"], 2, "recompute h.0 .. h.1"),
    "ddp-w1-every-layer": (DDP_CASES["w1-two-buckets-k3"], 1, "recompute embed .. head"),
    # the chunked head recomputing too: its first forward makes only the loss, its
    # recompute the loss and its gradients
    "ddp-w1-every-layer-chunked": (
        DDP_CASES["w1-two-buckets-k3"] + "loss chunk 24\n",
        1,
        "recompute embed .. head",
    ),
    "ddp-w2-one-block": (DDP_CASES["w2-param-buckets-k2"], 2, "recompute h.1"),
    "fsdp-w2-units": (FSDP_CASES["w2-three-units-p1-k2"], 2, "fsdp.recompute u2, u3"),
    "fsdp-w2-no-reshard": (FSDP_CASES["w2-three-units-no-reshard-k2"], 2, "recompute h.0"),
}


def with_recompute(text: str, line: str) -> str:
    if line.startswith("fsdp."):  # inside the fsdp block: units
        return text.replace("fsdp {", "fsdp {\n  " + line.removeprefix("fsdp."), 1)
    return text + line + "\n"


@pytest.mark.parametrize("trace", [False, True], ids=["fused", "traced"])
@pytest.mark.parametrize("text, world, line", CASES.values(), ids=CASES.keys())
def test_recompute_gives_bitwise_the_same_step(pool, text, world, line, trace):
    plain = pool.run(text, world, steps=2, trace=trace)
    again = pool.run(with_recompute(text, line), world, steps=2, trace=trace)
    assert_bitwise(plain, again)
    if trace:  # the recompute ops ran, each on its own
        names = {e["name"] for e in again.trace if e.get("ph") == "X"}
        assert any(n.startswith("recompute[") for n in names)
