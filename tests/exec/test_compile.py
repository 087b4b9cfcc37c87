"""`compile on` (schedc/exec/regions.py), the AdamW kernels, TF32 and the device checks.

Compiled and eager runs of one schedule, in this process at world 1, must make the same
steps. With aot_eager (dynamo and AOTAutograd running the traced aten graph with the eager
kernels, no code generation) they are bitwise equal: measured on nano over 2 steps under
single, DDP and FSDP schedules, fused and per-layer, every difference 0. That checks the
regions and the cut in seconds, exactly. Inductor generates other kernels (LayerNorm,
softmax and the cross-entropy reduce in another order), so it agrees to fp32 rounding:
measured on nano (world 1, fused regions, 2 steps) loss 7.7e-8 relative, gradients
6.0e-8 absolute, parameters 2.8e-4 x lr (AdamW divides by sqrt(v) + eps, which amplifies
a last-bit gradient difference where v is tiny; tests/oracle.py). Held to: loss 1e-6
relative, gradients rtol 1e-5 atol 1e-6, parameters rtol 1e-5 atol 1e-2 x lr.

Inductor is tested on one schedule only: a cold compile of the two regions of a world-1
nano step took 172 s on this loaded 2-core machine, 22 s with the inductor cache
(/tmp/torchinductor_$USER) warm.
"""

from __future__ import annotations

import os

import pytest
import torch

from schedc.compiler import compile_text
from schedc.errors import RunError
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions, pick_device
from schedc.exec.regions import BACKEND_ENV, Regions, set_tf32
from schedc.exec.train import check_gpus
from schedc.lang.resolve import Overrides
from schedc.model.reference import adamw_impl, make_adamw
from tests.ranks import python

pytestmark = pytest.mark.torch

HEAD = """model nano
world 1
batch 8 x 32
micro 2
seed 7
"""
SINGLE = HEAD
DDP = HEAD + "ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed  overlap on  no_sync on }\n"
FSDP = (
    HEAD
    + """fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head
       prefetch forward 1  prefetch backward 1 }
"""
)
_tags = iter(range(10**6))


@pytest.fixture(scope="module", autouse=True)
def _world(world1):
    """A one-process gloo world for this module's in-process executors."""


def run(text: str, *, compile: bool, steps: int = 2, trace: bool = False, into_grad=None):
    """`into_grad=False`: the eager run takes autograd's own embedding backward and head
    cast-back, as compiled regions do, instead of adding into .grad in place (gpt2.py's
    EmbeddingIntoGrad, CastIntoGrad: another order of fp32 additions, so not bitwise)."""
    c = compile_text(text, "t.sched", Overrides(steps=steps, compile=compile))
    ex = Executor(
        c,
        Comm(0, 1, tag=f"compile{next(_tags)}"),
        RunOptions(device="cpu", record=True, log=False, trace=trace),
    )
    if into_grad is not None:
        ex.model.embed_into_grad = into_grad
    out = [ex.step() for _ in range(steps)]
    ex.close()
    return ex, out


def assert_same_steps(a, b, exact: bool):
    for x, y in zip(a, b, strict=True):
        if exact:
            assert x.loss == y.loss
            assert all(torch.equal(x.grads[n], g) for n, g in y.grads.items())
            assert all(torch.equal(x.params[n], p) for n, p in y.params.items())
            continue
        assert abs(x.loss - y.loss) <= 1e-6 * abs(y.loss), (x.loss, y.loss)
        for n, g in y.grads.items():
            torch.testing.assert_close(x.grads[n], g, rtol=1e-5, atol=1e-6, msg=n)
        for n, p in y.params.items():
            torch.testing.assert_close(x.params[n], p, rtol=1e-5, atol=1e-2 * y.lr, msg=n)


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")


@pytest.mark.parametrize("text", [SINGLE, DDP, FSDP], ids=["single", "ddp", "fsdp"])
@pytest.mark.parametrize("trace", [False, True], ids=["fused", "per-layer"])
def test_compiled_cut_equals_eager(aot_eager, text, trace):
    """Per-layer (traced: every op alone) and fused regions, under every strategy."""
    torch._dynamo.reset()  # each case compiles its own graphs (counted below)
    before = graphs()
    ex, got = run(text, compile=True, trace=trace)
    assert graphs() > before  # dynamo compiled, nothing fell back to eager unseen
    _, want = run(text, compile=False, trace=trace, into_grad=False)
    assert_same_steps(got, want, exact=True)
    compiled = set(ex.regions.fns)
    assert compiled and not ex.regions.first_call  # every region ran compiled
    if trace:  # every op alone: each block through the one compiled Block
        assert {("h.0", "h.0"), ("h.1", "h.1")} <= compiled
    elif text is SINGLE:  # nothing separates embed .. h.1 (the head is cut for the tied wte)
        assert compiled == {("embed", "h.1"), ("head", "head")}


def test_inductor_world1_equals_eager():
    """The real thing: inductor code for the fused regions of a world-1 step."""
    if os.environ.get(BACKEND_ENV):
        pytest.skip(f"{BACKEND_ENV} is set")
    before = graphs()
    _, got = run(SINGLE, compile=True)
    assert graphs() >= before + 2  # embed .. h.1 and head
    _, want = run(SINGLE, compile=False)
    assert_same_steps(got, want, exact=False)


def test_compile_failure_is_one_clear_line(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "no_such_backend")
    with pytest.raises(RunError) as e:
        run(SINGLE, compile=True, steps=1)
    msg = str(e.value)
    assert "\n" not in msg and "compile on: torch.compile" in msg and "--compile off" in msg
    assert "embed" in msg and "no_such_backend" in msg


def test_regions_eager_without_compile():
    c = compile_text(SINGLE, "t.sched")
    from schedc.model.reference import init_model

    r = Regions(init_model(c.spec.model, 0), compile=False)
    x = torch.randint(0, 512, (2, 8))
    out = r("embed", "head")(x, x)
    assert out.dim() == 0 and not r.first_call


def test_adamw_kernels():
    """fused everywhere, in the executor and the reference alike (its found_inf skips an
    update on the device, so no value is read on the host before it)."""
    assert adamw_impl(torch.device("cpu")) == {"fused": True}
    assert adamw_impl(torch.device("cuda", 0)) == {"fused": True}
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = make_adamw([("w", p)], compile_text(SINGLE, "t.sched").spec.optim)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    ex, _ = run(FSDP, compile=False, steps=1)
    assert ex.optimizer.defaults["fused"] is True


def test_tf32_touches_cuda_only():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    assert set_tf32(torch.device("cpu"), True) is False
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before


@pytest.mark.parametrize(
    "local,count,ok", [(1, 1, True), (8, 8, True), (2, 1, False), (4, 0, False), (9, 8, False)]
)
def test_ranks_vs_gpus(local, count, ok):
    if ok:
        check_gpus(local, count)
        return
    with pytest.raises(RunError) as e:
        check_gpus(local, count)
    msg = str(e.value)
    assert "\n" not in msg and f"{local} ranks" in msg and f"{count} GPU" in msg
    assert "--nproc_per_node" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line():
    with pytest.raises(RunError, match="--device cuda, but torch sees no CUDA device"):
        pick_device("cuda")
    run = ["run", "schedules/tiny_1gpu.sched", "--steps", "1", "--device", "cuda"]
    r = python("-m", "schedc", *run, timeout=120)
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == ["schedc: error on rank 0: --device cuda, but torch sees no CUDA device"], (
        r.stderr
    )
