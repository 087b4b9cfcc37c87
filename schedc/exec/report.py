"""What a run says: the start line, a line a step, --log-json records, the closing
summary, the trace file and the memory report; printed by rank 0 (nanoGPT's habit)."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

from schedc.analysis.trace.write import trace_file
from schedc.compiler import Compiled
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, StepStats
from schedc.ir.spec import Spec


def log(comm: Comm, text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def start_line(compiled: Compiled, device: torch.device, threads: str) -> str:
    """What the run does, before its first step: schedule, strategy, mesh, batch, steps,
    device and threads."""
    spec, n = compiled.spec, torch.get_num_threads()
    kind = f"{spec.kind}"
    if spec.pipeline is not None:  # `single` would say nothing of its stages
        p = spec.pipeline
        kind = f"pipeline ({p.schedule.value}, {len(p.stages)} stages, {p.placement.value})"
        if p.units and spec.stage_mesh.replicate > 1:  # HSDP per stage: the replicas' mesh
            kind += f", dp {spec.dp} as mesh {spec.stage_mesh} (replicate x shard)"
    return (
        f"schedc: {compiled.source.path}: {kind}, world {spec.world}"
        + (f" as mesh {spec.mesh} (replicate x shard), " if spec.hsdp else ", ")
        + f"{spec.accum} micro-step{'s' if spec.accum != 1 else ''} of {spec.micro} x "
        f"{spec.seq_len}, {spec.steps} step{'s' if spec.steps != 1 else ''} "
        f"on {device.type} ({n} thread{'s' if n != 1 else ''} per rank{threads})"
    )


def step_line(st: StepStats, spec: Spec, device: torch.device, eta: float) -> str:
    """A step's log line: nanoGPT's numbers, or why its update was skipped."""
    if st.skipped:
        return (
            f"{step_label(st.step, spec.steps)} | skipped: {st.skipped} | "
            f"dt {st.dt_ms:.2f}ms | eta {fmt_eta(eta)}"
        )
    return format_log(
        st.step,
        st.loss,
        st.lr,
        st.grad_norm,
        st.dt_ms,
        st.tokens_per_s,
        mfu(spec, st.tokens_per_s, device),
        steps=spec.steps,
        eta_s=eta,
    )


def val_line(step: int, steps: int, loss: float, batches: int) -> str:
    """The validation loss after `step`, as build-nanogpt prints it, in the step lines' shape."""
    return f"{step_label(step, steps)} | val loss {loss:.6f} | over {batches} batches"


def eval_line(rec: dict, steps: int, val_batches: int) -> str:
    """An evaluation's line (its record: exec/evaluate.py): the validation loss, HellaSwag's
    accuracies in build-nanogpt's shape, or a sample (a newline in it written as \\n)."""
    if "val_loss" in rec:
        return val_line(rec["step"], steps, rec["val_loss"], val_batches)
    if "sample" in rec:
        return f"schedc: sample {rec['sample']}: " + rec["text"].replace("\n", "\\n")
    return (
        f"{step_label(rec['step'], steps)} | hellaswag acc_norm {rec['hellaswag_acc_norm']:.4f} "
        f"({rec['hellaswag_correct_norm']}/{rec['hellaswag_total']}) | "
        f"acc {rec['hellaswag_acc']:.4f}"
    )


def log_record(st, mfu: float | None = None) -> dict:
    """One --log-json line: numbers as JSON numbers (a non-finite one, which JSON cannot
    hold, as null), `skipped` a boolean and `skip_reason` why (null when not skipped);
    `mfu` (a fraction of peak) where it is known, as the log line has it."""

    def num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "step": st.step,
        "loss": num(st.loss),
        "lr": num(st.lr),
        "grad_norm": num(st.grad_norm),
        "dt_ms": num(st.dt_ms),
        "tokens_per_s": num(st.tokens_per_s),
        "skipped": bool(st.skipped),
        "skip_reason": st.skipped or None,
        **({"mfu": mfu} if mfu is not None and not st.skipped else {}),
    }


# --tensorboard: each record's numbers by tag, at the record's step
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "dt_ms": "train/dt_ms",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "val_loss": "val/loss",
    "hellaswag_acc_norm": "hellaswag/acc_norm",
    "hellaswag_acc": "hellaswag/acc",
}


class Records:
    """What rank 0 keeps of a run besides its log lines: each record as one JSON line of
    --log-json, and its numbers as TensorBoard scalars under --tensorboard (SCALARS; a
    skipped step's null ones are left out). Other ranks keep nothing."""

    def __init__(self, rank: int, log_json: str | None, tensorboard: str | None):
        self.file = open(log_json, "a") if log_json and rank == 0 else None
        self.tb = None
        if tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: slow

            self.tb = SummaryWriter(log_dir=tensorboard)

    def write(self, rec: dict) -> None:
        if self.file:
            self.file.write(json.dumps(rec, allow_nan=False) + "\n")
        if self.tb:
            for key, tag in SCALARS.items():
                if rec.get(key) is not None:
                    self.tb.add_scalar(tag, rec[key], global_step=rec["step"])
            if "sample" in rec:
                self.tb.add_text(f"samples/{rec['sample']}", rec["text"], global_step=rec["step"])

    def flush(self) -> None:
        """After each step and its evaluations: a run that is killed keeps what it logged."""
        if self.file:
            self.file.flush()
        if self.tb:
            self.tb.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


class RunClock:
    """Wall time of a run's steps: the ETA after each, and the summary at the end.

    The first step of a run pays for warm-up (allocations, gloo/NCCL connections, lazy
    initialisation: 2-3x a later step on CPU), so once a later step is done the ETA and the
    mean tokens/s leave it out. The ETA is wall time per step (checkpoints and logging
    included) times the steps left; tokens/s is tokens over the steps' own time (dt)."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps = first, steps
        self.t0 = time.perf_counter()
        self.t_warm: float | None = None  # when the first step ended
        self.stats: list = []
        self.val_loss: float | None = None  # the last validation loss measured
        self.hellaswag: dict | None = None  # the last HellaSwag record
        self.samples = 0  # samples logged

    def evaluated(self, rec: dict) -> None:
        """Keep what the summary says of an evaluation's record."""
        if "val_loss" in rec:
            self.val_loss = rec["val_loss"]
        elif "sample" in rec:
            self.samples += 1
        else:
            self.hellaswag = rec

    def done(self, st) -> float:
        """Record a finished step; return the seconds left, estimated: unknown (inf) after the
        warm-up step alone, which says little of a later step (14 s of a run were 1m01s)."""
        now = time.perf_counter()
        self.stats.append(st)
        left = self.steps - 1 - st.step
        if self.t_warm is None:
            self.t_warm = now
            return math.inf if left else 0.0
        return (now - self.t_warm) / (len(self.stats) - 1) * left

    def summary(self, peak: str) -> str:
        """The run in one paragraph: steps, total time, mean tokens/s without the warm-up
        step, final loss, updates skipped, peak memory."""
        if not self.stats:
            return f"schedc: done: nothing to run (resumed at step {self.first} of {self.steps})"
        total = time.perf_counter() - self.t0
        sts, n = self.stats, len(self.stats)
        later = sts[1:] or sts
        tok_s = sum(s.tokens_per_s * s.dt_ms for s in later) / sum(s.dt_ms for s in later)
        which = (
            f"mean over steps {later[0].step}-{later[-1].step} (step {sts[0].step}, the "
            f"warm-up, took {sts[0].dt_ms / 1e3:.2f}s and is left out)"
            if n > 1
            else f"of step {sts[0].step} alone, warm-up included"
        )
        losses = [s.loss for s in sts if not s.skipped]
        final = f"final loss {losses[-1]:.6f}" if losses else "no update made (all skipped)"
        skipped = n - len(losses)
        final += self._evaluations()
        text = (
            f"schedc: done: {n} step{'s' if n != 1 else ''} ({sts[0].step}-{sts[-1].step}"
            f" of {self.steps}) in {fmt_eta(total)}; {tok_s:,.0f} tokens/s {which}; {final}"
        )
        if skipped:
            text += f"; {skipped} update{'s' if skipped != 1 else ''} skipped (--nonfinite skip)"
        return f"{text}; {peak}" if peak else text

    def _evaluations(self) -> str:
        text = f"; final val loss {self.val_loss:.6f}" if self.val_loss is not None else ""
        if h := self.hellaswag:
            text += (
                f"; final HellaSwag acc_norm {h['hellaswag_acc_norm']:.4f} "
                f"({h['hellaswag_correct_norm']}/{h['hellaswag_total']})"
            )
        if self.samples:
            text += f"; {self.samples} sample{'s' if self.samples != 1 else ''} logged"
        return text


def peak_memory(device: torch.device) -> str:
    """Rank 0's peak memory, as the summary says it: CUDA's max allocated on a GPU, the
    process's peak resident set on a CPU (Linux and macOS), or nothing where unknown."""
    from schedc.passes.memory import fmt_bytes

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        return f"peak CUDA memory allocated {fmt_bytes(peak)} (rank 0)"
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return ""
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return f"peak RSS {fmt_bytes(rss * scale)} (rank 0's process)"


# Dense peak FLOP/s by device name, for MFU (bf16 tensor cores, as nanoGPT reports MFU;
# schedc trains in fp32, so its MFU reads low against these). SCHEDC_PEAK_FLOPS overrides.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
    "4090": 165e12,
}


def mfu(spec, tokens_per_s: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation of all ranks together: 6N + 12 L C T FLOPs per token (PaLM's
    estimate; N counts every parameter, where nanoGPT leaves out wpe) over the peak of D
    devices; None on a CPU or an unknown device."""
    if device.type != "cuda":
        return None
    peak = float(os.environ.get("SCHEDC_PEAK_FLOPS", 0)) or next(
        (v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), 0.0
    )
    if not peak:
        return None
    cfg = spec.model
    per_token = 6 * cfg.numel + 12 * cfg.n_layer * cfg.n_embd * spec.seq_len
    return per_token * tokens_per_s / (peak * spec.world)


def write_trace(path: str, ex: Executor, comm: Comm) -> None:
    """Every rank's spans (and probes), gathered into one chrome://tracing file by rank 0."""
    events = [e for part in comm.gather(ex.trace_events()) for e in part]
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(trace_file(events, ex.compiled.source.path), f)
        print(f"schedc: trace written to {path} ({len(events)} events)", flush=True)


def report_memory(compiled: Compiled, ex: Executor) -> None:
    """The compiler's memory prediction beside what the executor measured, per rank."""
    from schedc.passes.memory import fmt_bytes

    pred, meas = compiled.memory, ex.memory()
    rows = [
        ("model states", pred.states, meas["states"]),
        ("gathered units (peak)", pred.gathered_peak, meas["gathered_peak"]),
        ("unsharded grads (peak)", pred.grads_peak, meas["grads_peak"]),
    ]
    if "states" not in ex.mem:  # measured at every step's update: no step ran (a resumed
        # finished run), and a measurement of nothing would read as a claim ("0 B measured")
        text = "; ".join(f"{name} {fmt_bytes(p)} predicted" for name, p, _ in rows if p)
        print(
            f"schedc: memory per rank: {text}; no step ran, so nothing was measured",
            file=sys.stderr,
            flush=True,
        )
        return
    text = "; ".join(
        f"{name} {fmt_bytes(p)} predicted, {fmt_bytes(m)} measured" for name, p, m in rows if p or m
    )
    if meas.get("heap_peak"):  # CPU: live heap over the steps after the first
        text += (
            f"; peak (states, buffers, activations) {fmt_bytes(pred.peak)} predicted, "
            f"{fmt_bytes(meas['heap_peak'])} measured (live heap)"
        )
    if "cuda_max_allocated" in meas:
        text += (
            f"; cuda max allocated {fmt_bytes(meas['cuda_max_allocated'])}, max reserved "
            f"{fmt_bytes(meas['cuda_max_reserved'])}, allocator retries "
            f"{meas['cuda_alloc_retries']}"
        )
    print(f"schedc: memory per rank: {text}", file=sys.stderr, flush=True)


def format_log(
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    dt_ms: float,
    tokens_per_s: float,
    mfu: float | None = None,
    *,
    steps: int | None = None,
    eta_s: float | None = None,
) -> str:
    """build-nanogpt's log line; `mfu` is a fraction of peak FLOPs, printed as a percentage.
    With `steps`, the step reads `step    3/40` (llm.c's i/N; i counts from 0, as the trace,
    --log-json and every message that names a step do); with `eta_s`, the line ends with the
    estimated time left (`eta 1m12s`)."""
    line = (
        f"{step_label(step, steps)} | loss {loss:.6f} | lr {lr:.4e} | norm {grad_norm:.4f} | "
        f"dt {dt_ms:.2f}ms | tok/sec {tokens_per_s:.2f}"
    )
    if mfu is not None:
        line += f" | mfu {100 * mfu:.2f}%"
    return line if eta_s is None else f"{line} | eta {fmt_eta(eta_s)}"


def step_label(step: int, steps: int | None = None) -> str:
    """`step    3` or, of a run of 40 steps, `step    3/40`."""
    return f"step {step:4d}" if steps is None else f"step {step:4d}/{steps}"


def fmt_eta(seconds: float) -> str:
    """A time left as a person reads it: `0.4s`, `12s`, `1m12s`, `2h03m`; `-` not known yet."""
    if math.isinf(seconds):
        return "-"
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(round(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"
