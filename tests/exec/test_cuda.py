"""The CUDA path for real: CUDA streams, CUDA events, NCCL (skipped without a GPU, or run as
its CPU twin with SCHEDC_GPU_REHEARSAL=1: scripts/gpu_check.sh --rehearse).

One process runs every case at world 1 (NCCL on a GPU, gloo on the twin) for two steps and
holds each to the single-process CPU reference within the tolerance of the numerics it
declares (tests/oracle.py): `tf32 off` to fp32's, TF32 (on by default on CUDA) to the
derived TF32 bound, bf16 policies to theirs. The second step of each case runs with no host
read before its update is enqueued: under `torch.cuda.set_sync_debug_mode("error")` on a
GPU, counted by tests/exec/test_update.py's HostReads on the twin.

The plan-level guarantees of the CUDA lowering (a record on the producer's stream and a
wait on the consumer's before every cross-stream use) are tested without a GPU in
tests/passes/test_lower.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.cuda_ranks import DEVICE, gpu_or_twin
from tests.ranks import python, torchrun

pytestmark = [pytest.mark.gpu, gpu_or_twin]

DDP = """
model nano
world 1
batch 8 x 32
micro 2
seed 7
ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed  overlap on  no_sync on }
"""
FSDP = """
model nano
world 1
batch 8 x 32
micro 2
seed 7
fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head
       prefetch forward 1  prefetch backward 1 }
"""
CASES = {
    "ddp-fp32": DDP + "tf32 off\n",
    "fsdp-fp32": FSDP + "tf32 off\n",
    "ddp-tf32": DDP,  # TF32 on: the default on CUDA
    "fsdp-tf32": FSDP,
    "ddp-bf16": DDP + "precision bf16\n",
    "fsdp-bf16": FSDP + "precision bf16\n",
}

# Every case in one process: world 1 on NCCL (gloo on the CPU twin). Each prints one JSON
# line: what it was held to, and the first failure if it failed.
CHECK = r"""
import json, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from schedc.compiler import compile_text
from schedc.lang.resolve import Overrides
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from tests.oracle import assert_matches, reference_steps, tf32_in_effect
from tests.exec.test_update import HostReads
device, cases = sys.argv[1], json.loads(sys.stdin.read())
if device == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                        rank=0, world_size=1)


def quiet_step(ex):
    # no host read until the update is enqueued: an error on a GPU, counted on the CPU
    reads, step = HostReads(), ex.optimizer.step

    def enqueue(*a, **kw):
        out = step(*a, **kw)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        reads.enqueued = True
        return out

    ex.optimizer.step = enqueue
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with reads:
            return ex.step(), reads.before
    finally:
        ex.optimizer.step = step
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)


for i, (name, text) in enumerate(cases.items()):
    out = {"case": name}
    try:
        c = compile_text(text, f"{name}.sched", Overrides(steps=2))
        ex = Executor(c, Comm(0, 1, tag=f"case{i}"),
                      RunOptions(device=device, record=True, log=False, trace=True))
        got = [ex.step()]
        second, reads = quiet_step(ex)
        got.append(second)
        for s in got:
            s.grads = {n: t.cpu() for n, t in s.grads.items()}
            s.params = {n: t.cpu() for n, t in s.params.items()}
        tf32 = tf32_in_effect(c.spec.numerics, device)
        ref = reference_steps(text, 2, tf32=tf32)
        out.update(policy=ref.policy, tf32=tf32, host_reads_before_update=reads,
                   events=len(ex.trace_events()), memory=ex.memory(),
                   losses=[s.loss for s in got], ref_losses=[r.loss for r in ref])
        assert_matches(SimpleNamespace(steps=got), ref)
        out["ok"] = not reads
        ex.close()
    except Exception as e:  # noqa: BLE001 - every case reports
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
    print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    r = python("-c", CHECK, DEVICE, input=json.dumps(CASES), timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return {x["case"]: x for x in lines}


@pytest.mark.parametrize("case", CASES)
def test_a_step_on_the_device_matches_the_cpu_reference(results, case):
    res = results[case]
    print(json.dumps({k: v for k, v in res.items() if k != "memory"}))
    assert res["ok"], res.get("error") or f"host reads before the update: {res}"
    want = {"fp32": "float32", "tf32": "tf32" if DEVICE == "cuda" else "float32"}
    if case.endswith(("fp32", "tf32")):
        assert res["policy"] == want[case.split("-")[1]]
    else:
        assert res["policy"].startswith("bf16")
    assert res["events"] > 0
    if DEVICE == "cuda":
        assert res["memory"]["cuda_max_allocated"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("sched", ["tiny_ddp_overlap.sched", "tiny_fsdp_prefetch.sched"])
def test_two_gpus_under_torchrun(sched, tmp_path):
    def run(*args):
        return torchrun(2, f"schedules/{sched}", "--steps", "3", *args, timeout=600)

    cpu = run("--device", "cpu")
    gpu = run("--device", "cuda", "--tf32", "off", "--trace", str(tmp_path / "t.json"))
    assert cpu.returncode == 0 and gpu.returncode == 0, (cpu.stderr, gpu.stderr)

    def losses(out):
        return [
            float(x.split("loss ")[1].split()[0]) for x in out.splitlines() if x.startswith("step ")
        ]

    for a, b in zip(losses(cpu.stdout), losses(gpu.stdout)):
        assert abs(a - b) <= 1e-4 * abs(a)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"]  # not step slices
    assert {e["args"]["stream"] for e in ops} == {"compute", "comm"}


def test_the_twin_runs_only_when_asked():
    """Without a GPU these tests run only under the rehearsal, never by accident."""
    assert DEVICE == "cuda" or os.environ.get("SCHEDC_GPU_REHEARSAL") == "1"
