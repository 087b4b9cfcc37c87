"""GPT-2 on one GPU: schedc against build-nanogpt's loop, interleaved in one process.

    python bench/gpu.py                          # GPT-2 124M, batch 64 x 1024, micro 16, k = 4
    python bench/gpu.py --write-docs             # also record docs/benchmarks.md's GPU section
    python bench/gpu.py --smoke --device cpu     # tiny sizes, end to end on a CPU (a test)

Cases, all on the same model (schedc.model.gpt2, the same seed) and the same batches:
`nanogpt` is build-nanogpt's train_gpt2.py loop (TF32, bf16 autocast, fused AdamW,
torch.compile of the whole model, clipping, grad accumulation over k micro-steps);
`loop-bf16` is that loop without torch.compile, `loop-fp32` without any of them (fp32,
TF32 off; AdamW as schedc builds it, fused on CUDA). schedc runs at world 1 as a
single-process, a DDP-shaped and an FSDP-shaped schedule under each policy: `fp32` (TF32
on, as on CUDA by default), `bf16`, `bf16+compile`. Every case is built first; then round
after round each runs `--steps` steps, in a rotated order, so drift in the machine
(clocks, heat) favours no case. A case's first step (compilation) is not timed. Per case:
median step time, tokens/s, MFU (against the device's bf16 peak, as nanoGPT reports it),
its peak memory, the loss of step 0 (the cases compute the same step; bf16 and compiled
ones to within rounding), and the ratio to `nanogpt`. `--profile` adds the ops each step
dispatches and what dispatching them costs on this host.

Peak memory of a case while others are resident: the bytes it holds between steps
(measured when it was built, after its first step) plus the highest allocation above
everything resident while its own steps ran. On a CPU peak memory is not measured. Under
the table, the process's max reserved memory and allocator retries (all cases share the
caching allocator, so these are not per case).

`--budget-s` bounds the whole run: when it is spent, the remaining rounds are skipped and
the table says how many steps each case ran (scripts/gpu_check.sh runs this within 6
minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's schedc, whatever is installed

import torch
import torch.distributed as dist

from schedc.compiler import compile_text
from schedc.exec.executor import Comm, Executor, RunOptions
from schedc.exec.train import mfu
from schedc.lang.resolve import Overrides
from schedc.model.arch import SIZES
from schedc.model.data import load_batches
from schedc.model.reference import clip_coef, global_grad_norm, init_model, make_adamw

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


# -- cases ----------------------------------------------------------------------------------------


class Loop:
    """build-nanogpt's training loop (train_gpt2.py) on schedc's model and data (bf16 and
    compile), the same without torch.compile (bf16 only), or the plain fp32 loop."""

    def __init__(self, spec, device: torch.device, bf16: bool, compile: bool):
        self.spec, self.device, self.bf16 = spec, device, bf16
        self.tf32 = bf16 and device.type == "cuda"  # build-nanogpt: precision 'high'
        self.batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        self.model = init_model(spec.model, spec.seed).to(device)
        self.params = [p for _, p in self.model.named_parameters()]
        # fused AdamW on CUDA (build-nanogpt's use_fused), foreach on a CPU
        self.opt = make_adamw(self.model.named_parameters(), spec.optim)
        self.forward = torch.compile(self.model) if compile else self.model
        self.index = 0

    def step(self) -> float:
        s, k, dev = self.spec, self.spec.accum, self.device
        self.opt.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=dev)
        for j in range(k):
            x, y = self.batches.micro_batch(self.index, 0, j, s.micro, 1)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            ctx = (
                torch.autocast(dev.type, dtype=torch.bfloat16)
                if self.bf16
                else contextlib.nullcontext()
            )
            with ctx:
                _, loss = self.forward(x, y)
            loss = loss / k
            loss_accum += loss.detach()
            loss.backward()
        norm = global_grad_norm([p.grad for p in self.params])  # clip_grad_norm_'s norm
        coef = clip_coef(norm, s.optim.clip)
        for p in self.params:
            p.grad.mul_(coef)
        for g in self.opt.param_groups:
            g["lr"] = s.optim.lr_at(self.index, s.steps)
        self.opt.step()
        self.index += 1
        return loss_accum.item()  # waits for the device, as build-nanogpt's synchronize


class Schedc:
    """schedc's executor at world 1 on one schedule and policy.

    `outer_autocast` wraps the whole step in the policy's autocast, for an executor that
    does not apply `precision` itself (measurements taken before it did; nested autocast
    of the same dtype changes nothing once it does)."""

    def __init__(self, compiled, device: torch.device, tag: str, outer_autocast: bool = False):
        self.spec = compiled.spec
        self.tf32 = device.type == "cuda" and compiled.spec.numerics.tf32 is not False
        self.ex = Executor(compiled, Comm(0, 1, tag=tag), RunOptions(device=device.type, log=False))
        bf16 = str(compiled.spec.numerics.compute) == "bf16"
        self.ctx = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if outer_autocast and bf16
            else contextlib.nullcontext
        )

    def step(self) -> float:
        with self.ctx():
            return self.ex.step().loss


def set_tf32(device: torch.device, on: bool) -> None:
    """TF32 is process-wide state: set for each case before its steps (CUDA only)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


# -- the run --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--accum", type=int, default=4, help="micro-steps per update (k)")
    ap.add_argument("--steps", type=int, help="timed steps per case per round (3; smoke 1)")
    ap.add_argument("--rounds", type=int, help="rounds (2; smoke 1)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop rounds after this")
    ap.add_argument(
        "--autocast-step",
        action="store_true",
        help="wrap each bf16 schedc step in autocast (see Schedc)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, profile one step per case: aten ops dispatched "
        "and host time per op",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: nano, batch 4 x 32, micro 2, 1 round of 1 step "
        "(--steps, --rounds still apply)",
    )
    ap.add_argument(
        "--write-docs",
        nargs="?",
        const=str(ROOT / "docs" / "benchmarks.md"),
        metavar="MD",
        help="record the table in docs/benchmarks.md's GPU section",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.seq, a.micro, a.accum = "nano", 32, 2, 2
    a.steps = a.steps or (1 if a.smoke else 3)
    a.rounds = a.rounds or (1 if a.smoke else 2)
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench/gpu.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
            return 1
        torch.cuda.set_device(device)
    t_start = time.monotonic()
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )

    texts = schedule_texts(a)
    # what the issue must show first (a short budget builds these and skips the rest)
    names = (
        ["nanogpt"]
        + [f"schedc-{shape}-bf16+compile" for shape in ("single", "fsdp", "ddp")]
        + ["loop-fp32"]
        + [f"schedc-{shape}-{pol}" for pol in ("bf16", "fp32") for shape in texts]
        + ["loop-bf16"]
    )
    if a.cases:
        names = [n for n in names if n in a.cases.split(",")]
    cases, resident, first_loss, build_s, errors = {}, {}, {}, {}, {}
    for i, name in enumerate(names):
        if a.budget_s and time.monotonic() - t_start > 0.6 * a.budget_s:
            errors[name] = "not built: 60% of --budget-s spent building the cases before it"
            continue
        t0 = time.monotonic()
        before = _allocated(device)
        try:
            case = make_case(name, texts, a, device, i)
            set_tf32(device, case.tf32)
            first_loss[name] = case.step()  # compiles, allocates the optimizer state
        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name:<26} failed: {errors[name]}", flush=True)
            continue
        _sync(device)
        resident[name] = _allocated(device) - before
        cases[name] = case
        build_s[name] = time.monotonic() - t0
        print(
            f"{name:<26} built, first step {build_s[name]:6.1f} s, loss {first_loss[name]:.4f}",
            flush=True,
        )

    times: dict[str, list[float]] = {n: [] for n in cases}
    peaks: dict[str, int] = dict.fromkeys(cases, 0)
    order = list(cases)
    for r in range(a.rounds):
        if a.budget_s and time.monotonic() - t_start > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {r} of {a.rounds} rounds ran", flush=True)
            break
        rot = order[r % len(order) :] + order[: r % len(order)] if order else []
        for name in rot:
            if a.budget_s and time.monotonic() - t_start > a.budget_s:
                break  # the table says how many steps each case ran
            case = cases[name]
            set_tf32(device, case.tf32)
            _sync(device)
            base = _reset_peak(device)
            for _ in range(a.steps):
                t0 = time.perf_counter()
                case.step()  # .item() of the loss: the device has finished the step
                times[name].append(time.perf_counter() - t0)
            peaks[name] = max(peaks[name], _peak(device) - base)
        print(
            f"round {r}: "
            + ", ".join(
                f"{n} {1e3 * statistics.median(times[n]):.0f} ms" for n in order if times[n]
            ),
            flush=True,
        )

    table = summarize(a, device, cases, times, peaks, resident, first_loss, errors)
    if device.type == "cuda":  # process-wide: every case shares the caching allocator
        stats = torch.cuda.memory_stats(device)
        table += (
            f"\n\nallocator, whole process: max allocated "
            f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB since the last case's "
            f"reset, max reserved {torch.cuda.max_memory_reserved(device) / 2**20:.0f} MiB, "
            f"allocation retries {stats.get('num_alloc_retries', 0)}"
        )
    if a.profile:
        table += "\n\n" + profile(cases, device)
    print(table)
    print(f"({time.monotonic() - t_start:.0f} s)", flush=True)
    if a.write_docs:
        record(Path(a.write_docs), table, a, device, time.monotonic() - t_start)
    for case in cases.values():
        if isinstance(case, Schedc):
            case.ex.close()
    gc.collect()
    dist.destroy_process_group()
    return 1 if errors else 0


def make_case(name: str, texts: dict[str, str], a, device: torch.device, i: int):
    if name in ("nanogpt", "loop-fp32", "loop-bf16"):
        spec = compile_text(texts["single"], "loop.sched").spec
        return Loop(spec, device, bf16=name != "loop-fp32", compile=name == "nanogpt")
    _, shape, pol = name.split("-", 2)
    precision, comp = POLICIES[pol]
    compiled = compile_text(
        texts[shape], f"{shape}.sched", Overrides(precision=precision, compile=comp)
    )
    return Schedc(compiled, device, tag=f"gpu{i}", outer_autocast=a.autocast_step)


def profile(cases, device: torch.device) -> str:
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
    for name, case in cases.items():
        set_tf32(device, case.tf32)
        _sync(device)
        with prof_(activities=[ProfilerActivity.CPU]) as p:
            case.step()
        ops = sum(
            1
            for e in p.events()
            if e.name.startswith("aten::")
            and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        )
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


def summarize(a, device, cases, times, peaks, resident, first_loss, errors) -> str:
    base = statistics.median(times["nanogpt"]) if times.get("nanogpt") else None
    cuda = device.type == "cuda"
    lines = [
        (
            "| case | TF32 | steps timed | step ms (median) | tokens/s | MFU | peak GiB "
            "| loss step 0 | vs nanogpt tokens/s |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in cases.items():
        ts = times[name]
        if not ts:
            lines.append(f"| {name} | | 0 | | | | | {first_loss[name]:.4f} | |")
            continue
        med = statistics.median(ts)
        tok = case.spec.tokens_per_step / med
        m = mfu(case.spec, tok, device)
        peak = (resident[name] + peaks[name]) / 2**30 if cuda else None
        ratio = f"{base / med:.3f}x" if base else ""
        lines.append(
            f"| {name} | {'on' if case.tf32 else 'off'} | {len(ts)} | {1e3 * med:.1f} "
            f"| {tok:,.0f} | {f'{100 * m:.1f}%' if m else 'n/a'} "
            f"| {f'{peak:.1f}' if peak is not None else 'n/a'} "
            f"| {first_loss[name]:.4f} | {ratio} |"
        )
    for name, why in errors.items():
        lines.append(f"| {name} | | failed: {why.replace('|', '/')} | | | | | | |")
    return "\n".join(lines)


def record(path: Path, table: str, a, device: torch.device, secs: float) -> None:
    """Replace docs/benchmarks.md's GPU section with this run's table."""
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    cmd = " ".join(["python bench/gpu.py", *sys.argv[1:]])
    body = (
        f"{SECTION}\n\n`{cmd}` on {what}, torch {torch.__version__}, {a.model}, batch "
        f"{a.micro * a.accum} x {a.seq} (micro {a.micro}, k={a.accum}), {a.rounds} "
        f"round(s) x {a.steps} timed step(s) per case, {secs:.0f} s, "
        f"{time.strftime('%Y-%m-%d')}\n\n{table}\n"
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + 1)  # the next section
        text = text[:start] + body + ("\n" + text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + body
    path.write_text(text)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


if __name__ == "__main__":
    sys.exit(main())
