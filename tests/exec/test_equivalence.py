"""Every schedule computes what one process computes (fixed cases; generated ones: #6).

Real gloo ranks (tests/pool.py) run DDP and FSDP schedules of the `nano` model; after
each of two optimizer steps, the gradients (before clipping; FSDP's re-assembled from
the shards) and the updated parameters must equal the single-process reference of the
same global batch within tests/oracle.py's stated tolerances.
"""

from __future__ import annotations

import pytest

from tests.oracle import assert_matches

HEAD = """
model nano
world {world}
batch {seqs} x 32
micro {micro}
seed 7
optimizer adamw {{ lr = 1e-3  warmup = 1  clip = 1.0 }}
"""


def ddp(world: int, k: int, buckets: str, *, overlap=True, no_sync=True, micro=2) -> str:
    return (
        HEAD.format(world=world, seqs=micro * k * world, micro=micro)
        + f"""
ddp {{
  {buckets}
  overlap {"on" if overlap else "off"}
  no_sync {"on" if no_sync else "off"}
}}
"""
    )


def fsdp(
    world: int, k: int, units: str, *, fwd=1, bwd=1, reshard=True, no_sync=False, micro=2
) -> str:
    return (
        HEAD.format(world=world, seqs=micro * k * world, micro=micro)
        + f"""
fsdp {{
  {units}
  prefetch forward {fwd}
  prefetch backward {bwd}
  reshard_after_forward {"on" if reshard else "off"}
  no_sync {"on" if no_sync else "off"}
}}
"""
    )


ONE_BUCKET = "bucket all = embed .. head"
TWO_BUCKETS = "bucket b1 = head, h.1\n  bucket b2 = h.0, embed"
PER_PARAM = (
    "bucket b1 = head, h.1.mlp.c_proj.weight, h.1.mlp.c_proj.bias\n"
    "  bucket b2 = h.1.mlp.c_fc.weight, h.1.mlp.c_fc.bias, h.1.ln_2.weight, "
    "h.1.ln_2.bias, h.1.attn.c_proj.weight, h.1.attn.c_proj.bias, "
    "h.1.attn.c_attn.weight, h.1.attn.c_attn.bias, h.1.ln_1.weight, h.1.ln_1.bias, h.0\n"
    "  bucket b3 = wpe.weight\n  bucket b4 = wte.weight"
)
TIED_FIRST = "bucket b1 = head, wte.weight\n  bucket b2 = h.1 .. h.0, wpe.weight"
CAP = "bucket_cap 8 KiB first 2 KiB"

DDP_CASES = {
    "w1-one-bucket-k1": ddp(1, 1, ONE_BUCKET),
    "w1-two-buckets-k3": ddp(1, 3, TWO_BUCKETS),
    "w2-one-bucket-k1": ddp(2, 1, ONE_BUCKET),
    "w2-two-buckets-k2": ddp(2, 2, TWO_BUCKETS),
    "w2-two-buckets-k4-overlap-off": ddp(2, 4, TWO_BUCKETS, overlap=False),
    "w2-two-buckets-k3-sync-every-micro": ddp(2, 3, TWO_BUCKETS, no_sync=False),
    "w2-param-buckets-k2": ddp(2, 2, PER_PARAM),
    "w2-tied-in-first-bucket-k2": ddp(2, 2, TIED_FIRST),
    "w2-cap-k2": ddp(2, 2, CAP),
    "w2-cap-k1-overlap-off-sync": ddp(2, 1, CAP, overlap=False, no_sync=False),
    "w4-two-buckets-k1": ddp(4, 1, TWO_BUCKETS),
    "w4-cap-k2": ddp(4, 2, CAP),
    "w4-param-buckets-k3-sync-every-micro": ddp(4, 3, PER_PARAM, no_sync=False, micro=1),
    "w4-one-bucket-k4-overlap-off": ddp(4, 4, ONE_BUCKET, overlap=False, micro=1),
}

THREE_UNITS = (
    "unit tied = wte.weight keep\n  unit u1 = wpe.weight, h.0\n  unit u2 = h.1\n  unit u3 = head"
)
TWO_UNITS = "unit root = embed, head keep\n  unit blocks = h.0 .. h.1"
ONE_UNIT = "unit all = embed .. head"

FSDP_CASES = {
    "w1-three-units-p1": fsdp(1, 1, THREE_UNITS),
    "w1-two-units-p0-k2": fsdp(1, 2, TWO_UNITS, fwd=0, bwd=0),
    "w2-three-units-p0": fsdp(2, 1, THREE_UNITS, fwd=0, bwd=0),
    "w2-three-units-p1-k2": fsdp(2, 2, THREE_UNITS),
    "w2-three-units-p2-k2-no-sync": fsdp(2, 2, THREE_UNITS, fwd=2, bwd=2, no_sync=True),
    "w2-three-units-no-reshard-k2": fsdp(2, 2, THREE_UNITS, reshard=False),
    "w2-two-units-p1-k3-no-sync-no-reshard": fsdp(2, 3, TWO_UNITS, reshard=False, no_sync=True),
    "w2-one-unit-k2": fsdp(2, 2, ONE_UNIT),
    "w4-three-units-p1": fsdp(4, 1, THREE_UNITS),
    "w4-three-units-p2-k2": fsdp(4, 2, THREE_UNITS, fwd=2, bwd=1, micro=1),
    "w4-two-units-p0-k2-no-sync": fsdp(4, 2, TWO_UNITS, fwd=0, bwd=0, no_sync=True, micro=1),
    "w4-three-units-no-reshard-p2": fsdp(4, 1, THREE_UNITS, fwd=2, bwd=2, reshard=False),
}


@pytest.mark.parametrize("text", DDP_CASES.values(), ids=DDP_CASES.keys())
def test_ddp_equals_reference(pool, reference, text):
    world = int(text.split("world ")[1].split()[0])
    assert_matches(pool.run(text, world, steps=2), reference(text, 2))


@pytest.mark.parametrize("text", FSDP_CASES.values(), ids=FSDP_CASES.keys())
def test_fsdp_equals_reference(pool, reference, text):
    world = int(text.split("world ")[1].split()[0])
    assert_matches(pool.run(text, world, steps=2), reference(text, 2))


@pytest.mark.parametrize(
    "text",
    [DDP_CASES["w2-two-buckets-k2"], FSDP_CASES["w2-three-units-p1-k2"]],
    ids=["ddp", "fsdp"],
)
def test_float64_is_much_tighter(pool, reference, text):
    assert_matches(
        pool.run(text, 2, steps=2, dtype="float64"), reference(text, 2, "float64"), "float64"
    )


@pytest.mark.parametrize(
    "text",
    [DDP_CASES["w2-two-buckets-k2"], FSDP_CASES["w2-three-units-p1-k2"]],
    ids=["ddp", "fsdp"],
)
def test_traced_runs_every_op_alone_and_computes_the_same(pool, reference, text):
    """With --trace the executor runs each op on its own (no fused segments)."""
    result = pool.run(text, 2, steps=2, trace=True)
    assert_matches(result, reference(text, 2))
    names = {e["name"] for e in result.trace if e.get("ph") == "X"}
    assert "bwd[h.0]@mb1" in names and "fwd[embed]@mb0" in names
