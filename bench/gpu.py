"""GPT-2 on one GPU: schedc against build-nanogpt's loop, interleaved in one process.

    python bench/gpu.py --budget-s 170           # GPT-2 124M, batch 64 x 1024, micro 16, k = 4
    python bench/gpu.py --write-docs MD          # also write the table into MD's GPU section
    python bench/gpu.py --smoke --device cpu --compile-backend aot_eager   # a CPU rehearsal

One call on a GPU machine answers everything: it builds every case, times them in
interleaved rounds, profiles the three cases that decide the bars, and writes
`bench_gpu.json`, `trace_<case>.json.gz` (three) and, with --write-docs, the markdown
section, under --out (default: $OUT, else ./gpu-results): at most 5 files.

Cases, in this order (the ones that decide the bars first), all on the same model
(schedc.model.gpt2, the same seed) and the SAME batches, resident on the device: the
micro-batches of 4 distinct steps are copied there once and cycled over (ResidentBatches;
schedc's executor gets them as `batches=`, so its copy to the device is a no-op).
  nanogpt                     build-nanogpt's train_gpt2.py loop: TF32 (precision 'high'),
                              bf16 autocast, fused AdamW (on CUDA), torch.compile of the
                              whole model, clip_grad_norm_, loss/k over k micro-steps
  schedc-single-bf16+compile  schedc at world 1, one process, bf16, compiled regions
  schedc-fsdp-bf16+compile    the same, FSDP-shaped (a unit per block, prefetch, reshard)
  schedc-ddp-bf16+compile     the same, DDP-shaped (25 MiB buckets, overlap, no_sync)
  loop-fp32                   the loop without TF32, autocast or compile
  schedc-<shape>-bf16, -fp32  eager schedc (fp32: TF32 on, as on CUDA by default)
  loop-bf16                   the loop without torch.compile
--compile-backend (default inductor) is the backend of the loop's torch.compile and of
schedc's (SCHEDC_COMPILE_BACKEND); aot_eager rehearses the whole run on a CPU in seconds.

The bars: schedc-single-bf16+compile >= 1.00x nanogpt's tokens/s (0.95x the floor) with
a peak allocation no larger than nanogpt's; schedc-fsdp-bf16+compile >= 0.95x. A verdict
line per bar (met / floor / missed, with the ratio) ends the output and is in the JSON.

Budget (--budget-s bounds the whole run, from the interpreter's start): every case is
built, one after the other: its first step (compilation; not timed) and one untimed warm
step, which measures its memory and its step time. A case is left unbuilt only when the
time left cannot fit its build (estimated from the builds measured so far) plus one timed
round of every case built; a case after the three bar cases must also leave room for the
bar cases' full rounds (their 15 timed steps come first). The output names each case not
built and why. Then the rounds: as many as fit, from the measured step times, up to
--rounds (5, so 5 x 3 = 15 timed steps per case); each runs every case --steps steps, in
an order rotated by one each round, so drift in the machine (clocks, heat) favours no
case. When fewer than all rounds fit, the last ones run the bar cases only. Time for the
traces is reserved first. The table says how many steps each case ran. The exit status is
1 only if a case failed (an exception), never for the budget.

Per case: median and IQR (25th-75th percentile) of the step time, tokens/s from the median,
MFU (against the device's bf16 peak, as nanoGPT reports it), host issue time (schedc:
StepStats.issue_ms; the loop: until opt.step() returned, before loss.item()), the build
time (its first step's wall time), dynamo's counters during its build and steps (graphs
compiled, graph breaks, recompiles), and step 0's loss with its relative difference to
nanogpt's (the cases compute the same step: bf16 and compiled ones to within rounding).
Memory (CUDA only): peak allocated = the bytes the case holds between steps (measured when
it was built) plus the most allocated above everything resident while its own steps ran
(peak stats reset before them); peak reserved = its resident bytes plus what its warm step
reserved above the reserve it started from, the cache emptied first. Other cases stay
resident throughout, so these are the case's own bytes, not the device's total; the
process-wide maxima are under the table. The batches are allocated before any case, and
cuBLAS is warmed on the default stream first, so neither is counted in a case.

After the rounds, a 2-step torch.profiler trace (CPU + CUDA activities; CPU only on a CPU)
of nanogpt and the two bar cases is gzipped to `trace_<case>.json.gz` ('+' written '_'),
dropped if over 16 MiB. `--profile` adds the aten ops each case's step dispatches and what
dispatching them costs on this host.
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # --budget-s counts from here: torch's import is part of the run

import argparse
import contextlib
import gc
import gzip
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's schedc, whatever is installed

import torch
import torch._dynamo
import torch.distributed as dist

from schedc.compiler import compile_text
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from schedc.exec.report import mfu
from schedc.lang.resolve import Overrides
from schedc.model.arch import SIZES
from schedc.model.data import load_batches
from schedc.model.reference import init_model, make_adamw

HEAD = """model {model}
world 1
batch {seqs} x {seq}
micro {micro}
steps 1000
seed 1337
data corpus
optimizer adamw {{ lr = 6e-4  min_lr = 6e-5  warmup = 10 }}
"""
POLICIES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "bf16+compile": ("bf16", True)}
SECTION = "## GPU: schedc against build-nanogpt's loop"
BASE = "nanogpt"
BARS = (  # (case, target, floor or None, memory no larger than nanogpt's)
    ("schedc-single-bf16+compile", 1.00, 0.95, True),
    ("schedc-fsdp-bf16+compile", 0.95, None, False),
)
CORE = (BASE, *(b[0] for b in BARS))  # the cases that decide the bars: first, and traced
AIM_STEPS = 15  # timed steps per case the rounds aim for
RESIDENT_STEPS = 4  # distinct steps of batches kept on the device
TRACE_STEPS = 2
MAX_FILE = 16 * 2**20  # what the GPU machine returns per file
BACKEND_ENV = "SCHEDC_COMPILE_BACKEND"  # schedc/exec/regions.py reads it


def schedule_texts(a) -> dict[str, str]:
    """The three world-1 shapes (bench/run.py's, at world 1)."""
    head = HEAD.format(model=a.model, seqs=a.micro * a.accum, seq=a.seq, micro=a.micro)
    n = SIZES[a.model].n_layer
    return {
        "single": head,
        "ddp": head + "ddp {\n  bucket_cap 25 MiB\n  overlap on\n  no_sync on\n}\n",
        "fsdp": head
        + "fsdp {\n  unit root = embed, head keep\n"
        + "".join(f"  unit u{i} = h.{i}\n" for i in range(n))
        + "  prefetch forward 1\n  prefetch backward 1\n  reshard_after_forward on\n"
        f"  no_sync {'on' if a.accum > 1 else 'off'}\n}}\n",
    }


def case_names(texts) -> list[str]:
    return (
        [BASE]
        + [f"schedc-{shape}-bf16+compile" for shape in ("single", "fsdp", "ddp")]
        + ["loop-fp32"]
        + [f"schedc-{shape}-{pol}" for pol in ("bf16", "fp32") for shape in texts]
        + ["loop-bf16"]
    )


# -- data -----------------------------------------------------------------------------------------


class ResidentBatches:
    """The micro-batches of `steps` distinct steps, copied to the device once; step s reads
    those of step s mod `steps`. The `micro_batch` and `rows` of
    schedc.model.data.GlobalBatches, so the loop and schedc's executor (`batches=`, which
    reads its bound plan's slices) read the very same device tensors."""

    def __init__(self, source, device: torch.device, steps: int, accum: int, micro: int):
        self.steps, self.B, self.D = steps, micro, 1
        self.tokens_per_step = source.tokens_per_step
        self.held = {
            (s, j): tuple(t.to(device) for t in source.micro_batch(s, 0, j, micro, 1))
            for s in range(steps)
            for j in range(accum)
        }
        self.nbytes = sum(t.untyped_storage().nbytes() for xy in self.held.values() for t in xy)

    def micro_batch(
        self, step: int, rank: int, micro: int, B: int, D: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (rank, B, D) != (0, self.B, self.D):
            raise ValueError(f"resident batches hold rank 0 of 1 at micro {self.B}")
        return self.held[(step % self.steps, micro)]

    def rows(self, step: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-step whose slice `positions` is, at world 1 (a bound plan's)."""
        if len(positions) != self.B or positions.start % self.B:
            raise ValueError(f"resident batches hold whole micro-steps of {self.B}")
        return self.held[(step % self.steps, positions.start // self.B)]


# -- cases ----------------------------------------------------------------------------------------


class Loop:
    """build-nanogpt's training loop (train_gpt2.py) on schedc's model: bf16 and compiled,
    the same without torch.compile (bf16 only), or the plain fp32 loop."""

    def __init__(self, spec, device, batches, bf16: bool, compile: bool, backend: str):
        self.spec, self.device, self.bf16, self.batches = spec, device, bf16, batches
        self.compiled = compile
        self.tf32 = bf16 and device.type == "cuda"  # build-nanogpt: precision 'high'
        self.model = init_model(spec.model, spec.seed).to(device)
        # torch's own AdamW, fused (build-nanogpt's use_fused), as its users run it
        self.opt = make_adamw(self.model.named_parameters(), spec.optim, torch.optim.AdamW)
        self.forward = torch.compile(self.model, backend=backend) if compile else self.model
        self.index = 0

    def step(self) -> tuple[float, float]:
        """One update: (the loss, host ms until opt.step() returned)."""
        t0 = time.perf_counter()
        s, k, dev = self.spec, self.spec.accum, self.device
        self.opt.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=dev)
        for j in range(k):
            x, y = self.batches.micro_batch(self.index, 0, j, s.micro, 1)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if self.bf16 else _null()
            with ctx:
                _, loss = self.forward(x, y)
            loss = loss / k
            loss_accum += loss.detach()
            loss.backward()
        if s.optim.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.optim.clip)
        for g in self.opt.param_groups:
            g["lr"] = s.optim.lr_at(self.index, s.steps)
        self.opt.step()
        issue_ms = (time.perf_counter() - t0) * 1e3
        self.index += 1
        return loss_accum.item(), issue_ms  # waits for the device, as build-nanogpt's sync

    def close(self) -> None:
        pass


class Schedc:
    """schedc's executor at world 1 on one schedule and policy.

    `outer_autocast` wraps the whole step in the policy's autocast, for an executor that
    does not apply `precision` itself (measurements taken before it did; nested autocast
    of the same dtype changes nothing once it does)."""

    def __init__(self, compiled, device, batches, tag: str, outer_autocast: bool = False):
        self.spec = compiled.spec
        self.compiled = bool(compiled.spec.numerics.compile)
        self.tf32 = device.type == "cuda" and compiled.spec.numerics.tf32 is not False
        self.ex = Executor(
            compiled,
            Comm(0, 1, tag=tag),
            RunOptions(device=device.type, log=False, measure=False),  # no host-side peaks
            batches=batches,
        )
        bf16 = str(compiled.spec.numerics.compute) == "bf16"
        self.ctx = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if outer_autocast and bf16
            else _null
        )

    def step(self) -> tuple[float, float]:
        with self.ctx():
            st = self.ex.step()
        return st.loss, st.issue_ms

    def close(self) -> None:
        self.ex.close()


def _null():
    return contextlib.nullcontext()


def make_case(name: str, texts, a, device, batches, i: int):
    if name in (BASE, "loop-fp32", "loop-bf16"):
        spec = compile_text(texts["single"], "loop.sched").spec
        return Loop(spec, device, batches, name != "loop-fp32", name == BASE, a.compile_backend)
    _, shape, pol = name.split("-", 2)
    precision, comp = POLICIES[pol]
    compiled = compile_text(
        texts[shape], f"{shape}.sched", Overrides(precision=precision, compile=comp)
    )
    return Schedc(compiled, device, batches, tag=f"gpu{i}", outer_autocast=a.autocast_step)


def set_tf32(device: torch.device, on: bool) -> None:
    """TF32 is process-wide state: set for each case before its steps (CUDA only); 'high'
    matmul precision is what these switches set."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


# -- measurements ---------------------------------------------------------------------------------


def dynamo_counts() -> dict[str, int]:
    """dynamo's process-wide counters, read defensively (names move between versions):
    graphs compiled, graph breaks, recompiles (guard failures that led to one)."""
    out: dict = {"graphs": 0, "graph_breaks": 0, "recompiles": 0, "reasons": []}
    try:
        from torch._dynamo import utils as du
    except Exception:  # noqa: BLE001 - no dynamo: no counts
        return out
    c = getattr(du, "counters", {})
    with contextlib.suppress(Exception):
        out["graphs"] = int(c["stats"].get("unique_graphs", 0)) if "stats" in c else 0
    with contextlib.suppress(Exception):
        out["graph_breaks"] = int(sum(c["graph_break"].values())) if "graph_break" in c else 0
    with contextlib.suppress(Exception):
        if c.get("recompiles"):
            out["recompiles"] = int(sum(c["recompiles"].values()))
        else:  # torch 2.11-2.13: each recompilation's reasons land in guard_failures
            out["recompiles"] = sum(len(v) for v in getattr(du, "guard_failures", {}).values())
    with contextlib.suppress(Exception):
        out["reasons"] = [
            f"{getattr(code, 'co_name', code)}: {why}"
            for code, whys in getattr(du, "guard_failures", {}).items()
            for why in whys
        ]
    return out


def add_counts(acc: dict, before: dict) -> None:
    """Add what dynamo counted since `before` to `acc` (the first 8 recompile reasons,
    300 characters each, with them)."""
    now = dynamo_counts()
    for k, v in now.items():
        if k == "reasons":
            new = [r[:300] for r in v if r not in before.get(k, [])]
            acc[k] = (acc.get(k, []) + new)[:8]
        else:
            acc[k] = acc.get(k, 0) + v - before.get(k, 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def warm_cublas(device: torch.device) -> None:
    """Create cuBLAS's handle and workspace on the default stream before any case, so the
    first case's resident bytes do not hold them."""
    if device.type != "cuda":
        return
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(64, 64, device=device, dtype=dt, requires_grad=True)
        (w @ w).sum().backward()
    _sync(device)


class Rec:
    """What one case measured."""

    def __init__(self, case):
        self.case = case
        self.times: list[float] = []  # s per timed step
        self.issue: list[float] = []  # host ms per timed step
        self.construct_s = self.first_s = self.warm_s = 0.0
        self.loss0 = math.nan
        self.resident = 0  # bytes held between steps
        self.peak_above = 0  # most allocated above what was resident, over its timed steps
        self.warm_peak_above = 0
        self.warm_reserved_above = 0
        self.dyn: dict[str, int] = {}
        self.profile_ops: int | None = None

    @property
    def step_s(self) -> float:  # the estimate for planning
        return statistics.median(self.times) if self.times else self.warm_s


def iqr(ts: list[float]) -> tuple[float, float]:
    if len(ts) < 2:
        return (ts[0], ts[0]) if ts else (math.nan, math.nan)
    q = statistics.quantiles(ts, n=4, method="inclusive")
    return q[0], q[2]


# -- the run --------------------------------------------------------------------------------------


EPILOG = """\
cases, in this order: nanogpt (build-nanogpt's loop), schedc-single-bf16+compile,
  schedc-fsdp-bf16+compile, schedc-ddp-bf16+compile, loop-fp32,
  schedc-{single,ddp,fsdp}-{bf16,fp32}, loop-bf16
bars: schedc-single-bf16+compile >= 1.00x nanogpt tokens/s (0.95x floor), peak memory
  <= nanogpt's; schedc-fsdp-bf16+compile >= 0.95x
writes under --out: bench_gpu.json, trace_<case>.json.gz for nanogpt and the two bar
  cases ('+' as '_'); MD too with --write-docs. Exit 1 only if a case failed.
budget, rounds and memory: see the module docstring (bench/gpu.py)."""


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    ap.add_argument("--model", default="gpt2", help=f"{', '.join(SIZES)} (gpt2; smoke: nano)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (1024)")
    ap.add_argument("--micro", type=int, default=16, help="sequences per micro-step (16)")
    ap.add_argument("--accum", type=int, default=4, help="micro-steps per update, k (4)")
    ap.add_argument("--steps", type=int, help="timed steps per case per round (3; smoke 1)")
    ap.add_argument(
        "--rounds", type=int, help="rounds at most, fewer if the budget says so (5; smoke 3)"
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="(cuda)")
    ap.add_argument(
        "--cases", default="", metavar="A,B", help="comma-separated subset (default: all)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds for the whole run, builds, rounds and traces (0: no bound)",
    )
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="torch.compile backend of the loop and of schedc (inductor; aot_eager: "
        "no code generation, seconds on a CPU)",
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-results",
        metavar="DIR",
        help="where bench_gpu.json and the traces go (default: $OUT, else ./gpu-results)",
    )
    ap.add_argument(
        "--autocast-step",
        action="store_true",
        help="wrap each bf16 schedc step in autocast (see Schedc)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, count the aten ops one step of each case dispatches and "
        "the host time one dispatch costs",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: nano, batch 4 x 32, micro 2, k = 2, 3 rounds of 1 step "
        "(--steps, --rounds still apply)",
    )
    ap.add_argument(
        "--write-docs",
        nargs="?",
        const=str(ROOT / "docs" / "benchmarks.md"),
        metavar="MD",
        help="write the table into MD's GPU section (default MD: docs/benchmarks.md)",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.seq, a.micro, a.accum = "nano", 32, 2, 2
    a.steps = a.steps or (1 if a.smoke else 3)
    a.rounds = a.rounds or (3 if a.smoke else 5)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


class Run:
    def __init__(self, a, device: torch.device):
        self.a, self.device = a, device
        self.cuda = device.type == "cuda"
        self.deadline = T_START + a.budget_s if a.budget_s else math.inf
        self.recs: dict[str, Rec] = {}
        self.not_built: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.notes: list[str] = []
        self.rounds: list[list[str]] = []  # the cases each round ran
        self.traces: dict[str, str] = {}
        self.out = Path(a.out)
        self.names: list[str] = []

    # -- time -------------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def round_s(self, names) -> float:
        return sum(self.a.steps * self.recs[n].step_s for n in names if n in self.recs)

    def reserve_s(self, names) -> float:
        """Time kept for after the rounds: the traces (profiled steps run slower), the
        exports and the report."""
        ts = [n for n in names if n in CORE]
        per = 3.0 if self.cuda else 1.0
        return 3.0 + sum(2 * TRACE_STEPS * self.step_est(n) + per for n in ts)

    def step_est(self, name: str) -> float:
        if name in self.recs:
            return self.recs[name].step_s
        known = [r.step_s for r in self.recs.values()]
        return max(known) if known else 1.0

    def build_est(self, name: str) -> float:
        """A case's build: construction plus first step (compilation) plus a warm step,
        from the largest of those measured for cases of its kind (compiled or not)."""
        comp = "compile" in name or name == BASE
        same = [r for r in self.recs.values() if r.case.compiled == comp]
        cons = max((r.construct_s for r in self.recs.values()), default=1.0)
        if same:
            first = max(r.first_s for r in same)
        elif comp:
            first = 60.0
        else:
            first = 1.0 + 3 * self.step_est(name)
        return cons + first + self.step_est(name)

    # -- building ---------------------------------------------------------------------------

    def build_all(self, names, texts, batches) -> None:
        self.names = list(names)
        for i, name in enumerate(names):
            if i and self.a.budget_s:
                why = self.cannot_build(name)
                if why:
                    self.not_built[name] = why
                    print(f"{name:<27} not built: {why}", flush=True)
                    continue
            self.build(name, texts, batches, i)
            self.save()

    def cannot_build(self, name: str) -> str:
        built = [*self.recs, name]
        need = self.build_est(name) + self.round_s(built) + self.reserve_s(built)
        need += self.step_est(name) * self.a.steps * (name not in self.recs)
        core = [n for n in CORE if n in self.recs]
        if name not in CORE:  # the bar cases' remaining rounds come first
            need += (self.a.rounds - 1) * self.round_s(core)
        left = self.left()
        if need <= left:
            return ""
        what = "one timed round of every case built" + (
            "" if name in CORE else f" and {self.a.rounds - 1} more of the bar cases"
        )
        return (
            f"{max(left, 0):.0f} s of --budget-s left; its build (~{self.build_est(name):.0f} s"
            f" from those measured), {what} and the traces need ~{need:.0f} s"
        )

    def build(self, name, texts, batches, i) -> None:
        dev = self.device
        t0 = time.monotonic()
        before, dyn0 = _allocated(dev), dynamo_counts()
        rec = None
        try:
            case = make_case(name, texts, self.a, dev, batches, i)
            rec = Rec(case)
            rec.construct_s = time.monotonic() - t0
            set_tf32(dev, case.tf32)
            t1 = time.monotonic()
            rec.loss0, _ = case.step()  # compiles, allocates the optimizer state
            _sync(dev)
            rec.first_s = time.monotonic() - t1
            # the warm step: its memory (the cache emptied first) and its time
            if self.cuda:
                torch.cuda.empty_cache()
                res0, alloc0 = torch.cuda.memory_reserved(dev), _allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            t1 = time.perf_counter()
            case.step()
            rec.warm_s = time.perf_counter() - t1
            if self.cuda:
                rec.warm_peak_above = torch.cuda.max_memory_allocated(dev) - alloc0
                rec.warm_reserved_above = torch.cuda.max_memory_reserved(dev) - res0
            rec.resident = _allocated(dev) - before
        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
            self.failed[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            print(f"{name:<27} failed: {self.failed[name]}", flush=True)
            if rec is not None:
                with contextlib.suppress(Exception):
                    rec.case.close()
            return
        add_counts(rec.dyn, dyn0)
        self.recs[name] = rec
        print(
            f"{name:<27} built in {time.monotonic() - t0:5.1f} s (first step {rec.first_s:5.1f} s,"
            f" warm step {1e3 * rec.warm_s:7.1f} ms), loss {rec.loss0:.4f}, "
            f"dynamo {rec.dyn['graphs']} graphs {rec.dyn['graph_breaks']} breaks",
            flush=True,
        )

    # -- timing -----------------------------------------------------------------------------

    def run_rounds(self) -> None:
        a = self.a
        everyone = list(self.recs)
        core = [n for n in everyone if n in CORE]
        for r in range(a.rounds):
            names = [n for n in everyone if n in self.recs]  # failed ones drop out
            core = [n for n in core if n in self.recs]
            if a.budget_s:
                left = self.left() - self.reserve_s(names)
                later = (a.rounds - r - 1) * self.round_s(core)
                if left >= self.round_s(names) + later or not core or core == names:
                    if left < self.round_s(names):
                        self.notes.append(
                            f"budget: {r} of {a.rounds} rounds ran ({max(left, 0):.1f} s left "
                            f"for a round of {self.round_s(names):.1f} s)"
                        )
                        break
                elif left >= self.round_s(core):
                    if names != core and not any(n.startswith("bar-only") for n in self.notes):
                        self.notes.append(
                            f"bar-only: from round {r} on, only {', '.join(core)} ran "
                            "(the others' rounds did not fit in --budget-s)"
                        )
                    names = core
                else:
                    self.notes.append(
                        f"budget: {r} of {a.rounds} rounds ran ({max(left, 0):.1f} s left, a "
                        f"round of the bar cases takes {self.round_s(core):.1f} s)"
                    )
                    break
            k = r % len(names) if names else 0
            rot = names[k:] + names[:k]
            ran = []
            for name in rot:
                if a.budget_s and self.left() - self.reserve_s(names) < self.round_s([name]):
                    self.notes.append(f"budget: round {r} stopped before {name}")
                    break
                if self.time_case(name):
                    ran.append(name)
            self.rounds.append(ran)
            print(
                f"round {r}: "
                + ", ".join(
                    f"{n} {1e3 * statistics.median(self.recs[n].times):.1f} ms"
                    for n in names
                    if n in self.recs and self.recs[n].times
                ),
                flush=True,
            )
            self.save()

    def time_case(self, name: str) -> bool:
        rec, dev = self.recs[name], self.device
        set_tf32(dev, rec.case.tf32)
        _sync(dev)
        base = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = _allocated(dev)
        dyn0 = dynamo_counts()
        try:
            for _ in range(self.a.steps):
                t0 = time.perf_counter()
                _, issue_ms = rec.case.step()  # ends reading the loss: the device is done
                rec.times.append(time.perf_counter() - t0)
                rec.issue.append(issue_ms)
        except Exception as e:  # noqa: BLE001
            self.failed[name] = f"{type(e).__name__} in a timed step: {str(e)[:200]}"
            print(f"{name} failed: {self.failed[name]}", flush=True)
            del self.recs[name]
            with contextlib.suppress(Exception):
                rec.case.close()
            return False
        finally:
            add_counts(rec.dyn, dyn0)
        if self.cuda:
            rec.peak_above = max(rec.peak_above, torch.cuda.max_memory_allocated(dev) - base)
        return True

    # -- traces -----------------------------------------------------------------------------

    def trace_all(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        for name in CORE:
            if name not in self.names:
                continue  # not among --cases
            if name not in self.recs:
                self.traces[name] = "not traced: the case was not built or failed"
                continue
            if self.a.budget_s and self.left() < TRACE_STEPS * self.recs[name].step_s + 2:
                self.traces[name] = "not traced: --budget-s spent"
                continue
            rec, dev = self.recs[name], self.device
            set_tf32(dev, rec.case.tf32)
            _sync(dev)
            dyn0 = dynamo_counts()
            path = self.out / f"trace_{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json.gz"
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    raw = Path(tmp) / "trace.json"
                    with profile(activities=acts) as p:
                        for _ in range(TRACE_STEPS):
                            rec.case.step()
                        _sync(dev)
                    p.export_chrome_trace(str(raw))
                    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                size = path.stat().st_size
                if size > MAX_FILE:
                    path.unlink()
                    self.traces[name] = f"dropped: {size / 2**20:.1f} MiB gzipped, over 16 MiB"
                else:
                    self.traces[name] = path.name
            except Exception as e:  # noqa: BLE001 - a trace is not a case: report, go on
                path.unlink(missing_ok=True)
                self.traces[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            finally:
                add_counts(rec.dyn, dyn0)
            print(f"trace {name}: {self.traces[name]}", flush=True)

    # -- results ----------------------------------------------------------------------------

    def case_result(self, name: str) -> dict:
        rec = self.recs[name]
        ts, spec = rec.times, rec.case.spec
        out = {
            "tf32": rec.case.tf32,
            "compiled": rec.case.compiled,
            "steps_timed": len(ts),
            "step_ms": [1e3 * t for t in ts],
            "issue_ms": rec.issue,
            "construct_s": rec.construct_s,
            "first_step_s": rec.first_s,
            "warm_step_ms": 1e3 * rec.warm_s,
            "loss_step0": _num(rec.loss0),
            "dynamo": rec.dyn,
        }
        base = self.recs.get(BASE)
        if base is not None and math.isfinite(base.loss0) and base.loss0:
            out["loss_step0_rel_diff"] = _num(abs(rec.loss0 - base.loss0) / abs(base.loss0))
        if ts:
            med = statistics.median(ts)
            q1, q3 = iqr(ts)
            tok = spec.tokens_per_step / med
            out.update(
                step_ms_median=1e3 * med,
                step_ms_q1=1e3 * q1,
                step_ms_q3=1e3 * q3,
                tokens_per_s=tok,
                mfu=mfu(spec, tok, self.device),
                issue_ms_median=statistics.median(rec.issue),
            )
            if base is not None and base.times:
                out["vs_nanogpt_tokens_per_s"] = statistics.median(base.times) / med
        if self.cuda:
            out.update(
                resident_bytes=rec.resident,
                peak_allocated_bytes=rec.resident + max(rec.peak_above, rec.warm_peak_above),
                peak_reserved_bytes=rec.resident + rec.warm_reserved_above,
            )
        if rec.profile_ops is not None:
            out["aten_ops_per_step"] = rec.profile_ops
        return out

    def verdicts(self, res: dict) -> list[dict]:
        out = []
        base = res.get(BASE, {})
        for name, target, floor, memory in BARS:
            v = {"case": name, "target": target, "floor": floor, "memory_bar": memory}
            r = res.get(name, {})
            ratio = r.get("vs_nanogpt_tokens_per_s")
            if ratio is None:
                v.update(verdict="not measured", why=self._why_missing(name))
                out.append(v)
                continue
            v["ratio"] = ratio
            mem_ok = None
            if memory and "peak_allocated_bytes" in r and "peak_allocated_bytes" in base:
                mem_ok = r["peak_allocated_bytes"] <= base["peak_allocated_bytes"]
                v["peak_allocated_gib"] = r["peak_allocated_bytes"] / 2**30
                v["nanogpt_peak_allocated_gib"] = base["peak_allocated_bytes"] / 2**30
            v["memory_ok"] = mem_ok
            if mem_ok is False:
                v["verdict"], v["why"] = "missed", "peak allocated above nanogpt's"
            elif ratio >= target:
                v["verdict"] = "met"
            elif floor is not None and ratio >= floor:
                v["verdict"] = "floor"
            else:
                v["verdict"], v["why"] = (
                    "missed",
                    "tokens/s below the " + ("floor" if floor is not None else "bar"),
                )
            out.append(v)
        return out

    def short(self, smoke: bool) -> str:
        """What makes this run no measurement (""): no step timed at all, a case built but
        never timed, and in a --smoke rehearsal (whose point is that every case's code runs
        before a GPU is lent) any case not built."""
        untimed = [n for n, r in self.recs.items() if not r.times and n not in self.failed]
        if not any(r.times for r in self.recs.values()):
            return f"no step was timed ({len(self.recs)} of {len(self.names)} cases built)"
        if untimed:
            return f"built but never timed: {', '.join(untimed)}"
        if smoke and self.not_built:
            return (
                f"{len(self.not_built)} of {len(self.names)} cases not built "
                f"({', '.join(self.not_built)}): a rehearsal runs every case; raise --budget-s"
            )
        return ""

    def _why_missing(self, name: str) -> str:
        for n in (name, BASE):
            if n in self.failed:
                return f"{n} failed"
            if n in self.not_built:
                return f"{n} not built"
            if n in self.recs and not self.recs[n].times:
                return f"{n} ran no timed step"
            if n not in self.recs:
                return f"{n} not among --cases"
        return "no timed steps"

    def verdict_lines(self, verdicts) -> list[str]:
        lines = []
        for v in verdicts:
            want = f">= {v['target']:.2f}x nanogpt tokens/s" + (
                f" ({v['floor']:.2f}x floor)" if v["floor"] is not None else ""
            )
            if v["memory_bar"]:
                want += ", peak allocated <= nanogpt's"
            if v["verdict"] == "not measured":
                got = f"not measured ({v['why']})"
            else:
                why = f" ({v['why']})" if v.get("why") else ""
                got = f"{v['verdict'].upper()}{why}: {v['ratio']:.3f}x"
                if v["memory_bar"]:
                    got += (
                        f", peak {v['peak_allocated_gib']:.2f} vs "
                        f"{v['nanogpt_peak_allocated_gib']:.2f} GiB"
                        if v.get("memory_ok") is not None
                        else ", memory not measured (CPU)"
                    )
                if not self.cuda:
                    got += " (on a CPU: says nothing about the GPU)"
            lines.append(f"bar {v['case']} {want}: {got}")
        return lines

    def result(self, final: bool) -> dict:
        dev = self.device
        res = {n: self.case_result(n) for n in self.recs}
        verdicts = self.verdicts(res)
        out = {
            "final": final,
            "command": shlex.join(["python", "bench/gpu.py", *self.a.argv]),
            "device": torch.cuda.get_device_name(dev) if self.cuda else platform.machine(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config": {
                "model": self.a.model,
                "batch": [self.a.micro * self.a.accum, self.a.seq],
                "micro": self.a.micro,
                "accum": self.a.accum,
                "steps_per_round": self.a.steps,
                "rounds_max": self.a.rounds,
                "compile_backend": self.a.compile_backend,
                "resident_steps": RESIDENT_STEPS,
                "autocast_step": self.a.autocast_step,
            },
            "budget_s": self.a.budget_s or None,
            "spent_s": time.monotonic() - T_START,
            "rounds": self.rounds,
            "cases": res,
            "not_built": self.not_built,
            "failed": self.failed,
            "verdicts": verdicts,
            "traces": self.traces,
            "notes": self.notes,
        }
        if self.cuda:
            stats = torch.cuda.memory_stats(dev)
            out["allocator"] = {
                "max_reserved_bytes_since_last_reset": torch.cuda.max_memory_reserved(dev),
                "reserved_bytes": torch.cuda.memory_reserved(dev),
                "allocated_bytes": torch.cuda.memory_allocated(dev),
                "alloc_retries": stats.get("num_alloc_retries", 0),
                "ooms": stats.get("num_ooms", 0),
            }
        return out

    def save(self, final: bool = False) -> dict:
        """bench_gpu.json, rewritten after every build and round: a run killed by its
        timeout still leaves what it measured."""
        out = self.result(final)
        tmp = self.out / "bench_gpu.json.tmp"
        tmp.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
        tmp.replace(self.out / "bench_gpu.json")
        return out

    def table(self, res: dict) -> str:
        cuda = self.cuda
        head = (
            "| case | TF32 | steps timed | step ms median (IQR) | tokens/s | MFU "
            "| host issue ms | peak alloc / reserved GiB | first step s "
            "| graphs / breaks / recompiles | loss step 0 (rel. diff) | vs nanogpt tokens/s |"
        )
        lines = [head, "|" + "---|" * 12]
        for name, r in res["cases"].items():
            d = r["dynamo"]
            dyn = f"{d['graphs']} / {d['graph_breaks']} / {d['recompiles']}"
            rel = r.get("loss_step0_rel_diff")
            loss = f"{r['loss_step0']:.4f}" + (f" ({rel:.1e})" if rel is not None else "")
            mem = (
                f"{r['peak_allocated_bytes'] / 2**30:.2f} / {r['peak_reserved_bytes'] / 2**30:.2f}"
                if cuda
                else "n/a"
            )
            if not r["steps_timed"]:
                lines.append(
                    f"| {name} | {'on' if r['tf32'] else 'off'} | 0 | | | | | {mem} "
                    f"| {r['first_step_s']:.1f} | {dyn} | {loss} | |"
                )
                continue
            m = r["mfu"]
            ratio = r.get("vs_nanogpt_tokens_per_s")
            lines.append(
                f"| {name} | {'on' if r['tf32'] else 'off'} | {r['steps_timed']} "
                f"| {r['step_ms_median']:.1f} ({r['step_ms_q1']:.1f}-{r['step_ms_q3']:.1f}) "
                f"| {r['tokens_per_s']:,.0f} | {f'{100 * m:.1f}%' if m else 'n/a'} "
                f"| {r['issue_ms_median']:.1f} | {mem} | {r['first_step_s']:.1f} | {dyn} "
                f"| {loss} | {f'{ratio:.3f}x' if ratio else ''} |"
            )
        for name, why in {**self.not_built, **self.failed}.items():
            what = "not built" if name in self.not_built else "failed"
            lines.append(f"| {name} | | {what}: {why.replace('|', '/')} |" + " |" * 9)
        lines += ["", *(f"- {v}" for v in self.verdict_lines(res["verdicts"]))]
        few = {n: r["steps_timed"] for n, r in res["cases"].items() if r["steps_timed"] < AIM_STEPS}
        notes = list(self.notes)
        if few:
            smoke = " (--smoke)" if self.a.smoke else ""
            if len(few) == len(res["cases"]) and len(set(few.values())) == 1:
                k = next(iter(few.values()))
                notes.append(f"every case ran {k} timed steps, fewer than {AIM_STEPS}{smoke}")
            else:
                notes.append(
                    f"fewer than {AIM_STEPS} timed steps: "
                    + ", ".join(f"{n} {k}" for n, k in few.items())
                    + smoke
                )
        notes.append(
            f"{len(self.rounds)} round(s) of {self.a.steps} step(s); the order rotated by one "
            "each round"
        )
        if cuda:
            al = res["allocator"]
            notes.append(
                "host issue ms: schedc's reads the loss and the gradient norm (its non-finite "
                "check) before it enqueues the update, so it includes waiting for the "
                "forward and backward; the loop's stops when opt.step() returns, before "
                "any host read"
            )
            notes.append(
                f"allocator, whole process: max reserved "
                f"{al['max_reserved_bytes_since_last_reset'] / 2**30:.2f} GiB since the last "
                f"reset, reserved now {al['reserved_bytes'] / 2**30:.2f} GiB, allocation "
                f"retries {al['alloc_retries']}, OOMs {al['ooms']}"
            )
        else:
            notes.append("on a CPU: no peak memory, no MFU; the step times say nothing")
        traces = ", ".join(f"{n}: {t}" for n, t in res["traces"].items())
        if traces:
            notes.append(f"traces ({TRACE_STEPS} steps each): {traces}")
        lines += [f"- {n}" for n in notes]
        return "\n".join(lines)


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def set_up(a: argparse.Namespace) -> torch.device | None:
    """The device, dynamo's limits and a world-1 process group; None when there is no GPU."""
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/gpu.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
            return None
        # the device schedc's executor picks (LOCAL_RANK, else 0); set_device needs an index
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ[BACKEND_ENV] = a.compile_backend  # schedc's compiled regions read it
    for knob in ("recompile_limit", "cache_size_limit"):  # many compiled cases share one process
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )
    return device


def chosen_cases(a: argparse.Namespace, names: list[str]) -> list[str] | None:
    """The cases `--cases` names, in the bench's order; None (said) for an unknown one."""
    if not a.cases:
        return names
    wanted = a.cases.split(",")
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"bench/gpu.py: unknown case(s) {', '.join(unknown)}", file=sys.stderr)
        return None
    return [n for n in names if n in wanted]


def main(argv=None) -> int:
    a = parse(argv)
    device = set_up(a)
    if device is None:
        return 1
    texts = schedule_texts(a)
    names = chosen_cases(a, case_names(texts))
    if names is None:
        return 2
    run = Run(a, device)
    spec = compile_text(texts["single"], "loop.sched").spec
    source = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
    batches = ResidentBatches(source, device, RESIDENT_STEPS, spec.accum, spec.micro)
    warm_cublas(device)
    print(
        f"bench/gpu.py: {a.model}, batch {spec.seqs} x {spec.seq_len} (micro {spec.micro}, "
        f"k={spec.accum}) on {device}, backend {a.compile_backend}, "
        f"{len(names)} cases, budget {a.budget_s or 'none'} s; "
        f"batches of {RESIDENT_STEPS} steps resident ({batches.nbytes / 2**20:.1f} MiB), "
        f"{time.monotonic() - T_START:.0f} s since start",
        flush=True,
    )
    run.build_all(names, texts, batches)
    run.run_rounds()
    prof_lines = profile_ops(run.recs, device) if a.profile else ""
    run.trace_all()
    table = run.table(run.save(final=True))
    if prof_lines:
        table += "\n\n" + prof_lines
    print(table)
    spent = time.monotonic() - T_START
    print(f"({spent:.0f} s; results in {Path(a.out) / 'bench_gpu.json'})", flush=True)
    if a.write_docs:
        record(Path(a.write_docs), table, a, device, spent, len(run.rounds))
    for rec in run.recs.values():
        rec.case.close()
    gc.collect()
    dist.destroy_process_group()
    if short := run.short(a.smoke):
        print(f"bench/gpu.py: FAILED: {short}", flush=True)
        return 1
    return 1 if run.failed else 0


def profile_ops(recs: dict[str, Rec], device: torch.device) -> str:
    """Python and dispatcher cost: the ops one step of each case dispatches (torch.profiler),
    times what one dispatch costs on this host.

    `aten ops` counts the ops a step dispatched from Python or from a compiled graph's
    wrapper (aten events whose parent is not an aten op: what runs inside one is not
    dispatched again), forward, backward and optimizer alike. `dispatch us` is the host
    time of one tiny op from Python to its kernel and back (the median of 2,000 additions
    of one-element tensors on this device), so ops x that is the host time a step needs
    at least. On a GPU that time is hidden while it stays below the device's time for the
    step; what exceeds it is the step's dispatch bound.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_

    us = dispatch_us(device)
    lines = [
        f"dispatch: {us:.1f} us per op on this host ({device.type})",
        "",
        "| case | aten ops/step | host ms/step at least (ops x dispatch) |",
        "|---|---|---|",
    ]
    for name, rec in recs.items():
        set_tf32(device, rec.case.tf32)
        _sync(device)
        with prof_(activities=[ProfilerActivity.CPU]) as p:
            rec.case.step()
        ops = sum(
            1
            for e in p.events()
            if e.name.startswith("aten::")
            and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        )
        rec.profile_ops = ops
        lines.append(f"| {name} | {ops} | {ops * us / 1e3:.2f} |")
    return "\n".join(lines)


def dispatch_us(device: torch.device, n: int = 2000, repeats: int = 7) -> float:
    """Median host microseconds of one dispatched op whose kernel does nothing to speak of."""
    x = torch.zeros(1, device=device)
    y = torch.ones(1, device=device)
    runs = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, y, out=x)
        runs.append((time.perf_counter() - t0) / n)  # launches only: no sync inside
    _sync(device)
    return 1e6 * statistics.median(runs)


def record(path: Path, table: str, a, device: torch.device, secs: float, rounds: int) -> None:
    """Replace the markdown file's GPU section with this run's table."""
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    cmd = shlex.join(["python", "bench/gpu.py", *a.argv])
    body = (
        f"{SECTION}\n\n`{cmd}` on {what}, torch {torch.__version__}, {a.model}, batch "
        f"{a.micro * a.accum} x {a.seq} (micro {a.micro}, k={a.accum}), backend "
        f"{a.compile_backend}, {rounds} round(s) x {a.steps} timed step(s) per case, "
        f"{secs:.0f} s, {time.strftime('%Y-%m-%d')}\n\n{table}\n"
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + 1)  # the next section
        text = text[:start] + body + ("\n" + text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + body
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
