"""The CUDA path for real: CUDA streams, CUDA events, NCCL groups (skipped without a GPU).

The plan-level guarantees of the CUDA lowering (a record on the producer's stream and a
wait on the consumer's before every cross-stream use) are tested without a GPU in
tests/passes/test_lower.py; these tests run the same plans on a device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]

# One process: world 1 on NCCL, the executor's gradients and parameters vs the CPU
# reference of the same schedule, printed as JSON (max errors per step).
CHECK = r"""
import json, sys, torch, torch.distributed as dist
from schedc.compiler import compile_text
from schedc.lang.resolve import Overrides
from schedc.exec.executor import Comm, Executor, RunOptions
from tests.oracle import reference_steps
text = sys.stdin.read()
c = compile_text(text, "gpu.sched", Overrides(steps=2))
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
torch.cuda.set_device(0)
ex = Executor(c, Comm(0, 1), RunOptions(device="cuda", record=True, log=False, trace=True))
got = [ex.step() for _ in range(2)]
ref = reference_steps(text, 2)
out = []
for g, r in zip(got, ref):
    dg = max((g.grads[n].cpu() - r.grads[n]).abs().max().item() for n in r.grads)
    dp = max((g.params[n].cpu() - r.params[n]).abs().max().item() for n in r.params) / r.lr
    out.append({"loss": g.loss, "ref_loss": r.loss, "dgrad": dg, "dparam_lr": dp})
print(json.dumps({"steps": out, "memory": ex.memory(), "events": len(ex.trace_events())}))
"""

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


@pytest.mark.parametrize("text", [DDP, FSDP], ids=["ddp", "fsdp"])
def test_cuda_step_matches_cpu_reference(text):
    r = subprocess.run(
        [sys.executable, "-c", CHECK],
        input=text,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for s in res["steps"]:
        assert abs(s["loss"] - s["ref_loss"]) <= 1e-4 * abs(s["ref_loss"])
        assert s["dgrad"] <= 1e-4  # GPU kernels differ from the CPU's in the last bits
        assert s["dparam_lr"] <= 5e-2
    assert res["memory"]["cuda_max_allocated"] > 0
    assert res["events"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("sched", ["tiny_ddp_overlap.sched", "tiny_fsdp_prefetch.sched"])
def test_two_gpus_under_torchrun(sched, tmp_path):
    cpu = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "schedc",
            "run",
            f"schedules/{sched}",
            "--steps",
            "3",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    gpu = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "schedc",
            "run",
            f"schedules/{sched}",
            "--steps",
            "3",
            "--device",
            "cuda",
            "--trace",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
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
