"""Agreement of two schedules under numerics (issue 13): the batch decides agreement, and
differing numerics are reported, not hidden behind "the same update" (passes/agree.py)."""

from __future__ import annotations

from schedc.compiler import compile_file, compile_text
from schedc.passes.agree import compare
from tests.goldens import REPO

ONE = """model nano
world 1
batch 8 x 32
micro 2
{extra}
"""

FSDP = """model nano
world 2
batch 8 x 32
micro 2
{extra}
fsdp {{ unit all = embed .. head }}
"""

DDP = """model nano
world 2
batch 8 x 32
micro 2
{extra}
ddp {{ bucket all = head .. embed }}
"""


def spec(text: str, extra: str = ""):
    return compile_text(text.format(extra=extra)).spec


def test_the_same_policy_agrees_with_nothing_to_report():
    for extra in ("", "precision bf16\ncompile on", "precision bf16 { reduce = bf16 }"):
        r = compare(spec(FSDP, extra), spec(FSDP, extra))
        assert r.agree and r.numerics == (), extra


def test_different_compute_dtypes_agree_on_the_batch_and_say_so():
    r = compare(spec(ONE), spec(ONE, "precision { compute = bf16 }"))
    assert r.agree and r.diagnostics == ()
    assert r.numerics == ("compute fp32 vs bf16",)


def test_every_dtype_that_differs_is_named():
    r = compare(spec(FSDP), spec(FSDP, "precision bf16 { reduce = bf16 }\ncompile on"))
    assert r.agree
    assert r.numerics == (
        "compute fp32 vs bf16",
        "gather fp32 vs bf16",
        "reduce fp32 vs bf16",
        "compile off vs on",
    )


def test_only_the_arithmetic_a_schedule_does_counts():
    # one process and DDP compute with the fp32 master weights: `precision bf16` gathers
    # nothing there, and one process reduces nothing
    assert compare(spec(ONE, "precision bf16"), spec(DDP, "precision bf16")).numerics == ()
    # but an FSDP unit gathered in bf16 is computed with bf16-rounded weights
    assert compare(spec(ONE, "precision bf16"), spec(FSDP, "precision bf16")).numerics == (
        "gather fp32 vs bf16",
    )
    # a bf16 all-reduce rounds even at world 1; one process has none to round
    assert compare(
        spec(ONE, "precision bf16"), spec(DDP, "precision bf16 { reduce = bf16 }")
    ).numerics == ("reduce fp32 vs bf16",)
    # tf32 unset is on (CUDA) or moot (CPU); off differs, but only for fp32 matmuls
    assert compare(spec(ONE, "tf32 on"), spec(ONE)).numerics == ()
    assert compare(spec(ONE, "tf32 off"), spec(ONE)).numerics == ("tf32 off vs on",)
    assert (
        compare(spec(ONE, "precision bf16\ntf32 off"), spec(ONE, "precision bf16")).numerics == ()
    )
    # compiling fp32 layers reorders sums, as another world size does; below fp32 it moves
    # the points where values are rounded
    assert compare(spec(ONE, "compile on"), spec(ONE)).numerics == ()
    assert compare(
        spec(ONE, "precision bf16\ncompile on"), spec(ONE, "precision bf16")
    ).numerics == ("compile on vs off",)


def test_a_batch_that_differs_still_fails_whatever_the_numerics():
    r = compare(spec(ONE), spec(ONE.replace("batch 8 x 32", "batch 16 x 32"), "precision bf16"))
    assert not r.agree and r.numerics == ("compute fp32 vs bf16",)


def test_the_bundled_gpt2_pair_agrees_under_its_policy():
    a, b = (compile_file(REPO / "schedules" / f"gpt2_{n}.sched").spec for n in ("1gpu", "8gpu"))
    assert a.numerics == b.numerics and a.numerics.compute.value == "bf16" and a.numerics.compile
    r = compare(a, b)
    assert r.agree and r.numerics == ()
