"""The memory ledger of a pipeline: per pipeline rank, along its proven program.

    predict_pipeline(spec, pipe, programs) -> {pipeline rank: MemoryReport}

A pipeline rank holds the model states of its stages only, and the activations of the
micro-batches it has run forward and not yet backward: how many are in flight at once is
the schedule's (GPipe: all m on every rank; 1F1B: p - r on rank r; interleaved and zero
bubble in between), and is what makes one schedule fit where another does not. The ledger
walks the rank's items in the order the executor runs them (exec/pipeline.py), with the
executor's own buffers, each in its dtype (`N` = micro x seq_len tokens, `C` = n_embd, `x`
the residual stream's bytes: fp32, or FSDP's gather dtype, ir/sizes.py `stream_bytes`):

* states, fp32: 16 bytes a parameter of the rank's stages (parameter, gradient, Adam m and
  v; the tied wte once a rank: one parameter where one rank holds embed and head, a copy
  on each end otherwise). FSDP per stage keeps each unit's shard (the unit padded to a
  multiple of S, / S, S the shard group's ranks: dp, or under HSDP per stage a `mesh R x S`'s
  S, whose replicate all-reduce sums the reduce-scatter's output in place, the DP ledger's
  rule) and its fp32 gradient shard from the unit's reduce-scatter to the update; its full
  unit in the gather dtype lives from the rank's first item (the gathers are launched
  together) until the stage's last B or W, and the stage's unsharded gradient
  in the gather dtype from the stage's first B or W until the reduce-scatter that takes it
  is retired, before the update (what the collective sends lives as long).
* DP with replicas (no fsdp block): the stage's flat bucket, or each of its buckets in the
  ddp block, a copy of its gradients in the reduce dtype, from its last B or W until the
  update waits for it.
* activations of (stage s, micro-batch j), from F[s]@j to B[s]@j (or W[s]@j in a split
  schedule: I keeps the graph for W, and past the first stage the gradients W starts from,
  ir/sizes.py `weight_grad_stash`, from I to W, freeing what only the loss's side saved,
  `above_weights`): what autograd saves for the stage's layers
  (ir/sizes.py `layer_acts`, the DP ledger's rule), and, but on the last stage, the
  stage's output N C x (kept for the backward; the next stage saves it as its input when
  it is on the same rank, so it is not counted twice).
* transfers: a received activation (N C x) from its RECV_F until its F saves it; a received
  output gradient (N C x) from its RECV_B until the B or I that reads it ends; an input
  gradient (N C x), from the B or I that makes it until its SEND_B is done (or the local
  stage before reads it).

The peak is over the program with each compute action's own scratch on top while it runs
(its layers' largest transient, the DP ledger's), `settled_peak` the same at item boundaries
without it; the peak is what a pipeline file's `memory` budget is checked against, per rank.
"""

from __future__ import annotations

from collections import defaultdict

from schedc.ir.effects import Alloc, Free, Part
from schedc.ir.op import STAGE_COMPUTE, Kind, Op
from schedc.ir.pipeline import Item, Pipeline, Programs, last_grad_writers
from schedc.ir.sizes import above_weights, layer_acts, padded, stream_bytes, weight_grad_stash
from schedc.ir.spec import TIED, Spec, rank_buckets
from schedc.lang.diagnostics import Diagnostics
from schedc.model.arch import FP32
from schedc.passes.memory import Ledger, MemoryReport, fmt_bytes


class _Walk:
    """What lives on one pipeline rank, added up by the DP ledger's `Ledger` (each part's
    peak, the total's and what it is made of, the peak without transients); a buffer of no
    bytes is not allocated, and freeing one that never was is nothing."""

    def __init__(self) -> None:
        self.led = Ledger()

    def alloc(self, name: str, part: Part, nbytes: int) -> None:
        if nbytes:
            self.led.apply(Alloc(name, part, nbytes), "")

    def free(self, name: str) -> None:
        if name in self.led.live:
            self.led.apply(Free(name), "")

    def measure(self, at: str, transient: int = 0) -> None:
        """What lives now, and `transient` on top of it: an op's own scratch while it runs
        (its layers' largest, ir/sizes.py `layer_acts`), counted in the peak only."""
        self.led.measure(at, 0, transient)

    def report(self) -> MemoryReport:
        return self.led.report(self.led.by_part[Part.STATES])


def stage_params(spec: Spec, stage: int) -> list[str]:
    """The parameters a stage's layers compute with (head's tied wte included)."""
    assert spec.pipeline is not None
    cfg = spec.model
    out = [p.name for layer in spec.pipeline.stages[stage].layers for p in cfg.layer_params(layer)]
    if "head" in spec.pipeline.stages[stage].layers and TIED not in out:
        out.append(TIED)
    return out


def predict_pipeline(spec: Spec, pipe: Pipeline, programs: Programs) -> dict[int, MemoryReport]:
    """Each pipeline rank's predicted memory along its program."""
    assert spec.pipeline is not None
    # once, not once a rank: a rank per stage made these O(stages^2) (4,098 stages: 4 s)
    numel = {p.name: p.numel for p in spec.model.params}
    units: dict[int, list[int]] = defaultdict(list)  # stage -> its units' places in the spec
    for k, u in enumerate(spec.pipeline.units):
        units[u.stage].append(k)
    return {r: _RankLedger(spec, pipe, r, numel, units).run(programs[r]) for r in sorted(programs)}


class _RankLedger:
    """One pipeline rank's walk: the executor's buffers, allocated and freed per action."""

    def __init__(
        self,
        spec: Spec,
        pipe: Pipeline,
        rank: int,
        numel: dict[str, int],
        units: dict[int, list[int]],
    ):
        assert spec.pipeline is not None
        self.spec, self.pipe, self.w = spec, pipe, _Walk()
        cfg, self.dp = spec.model, spec.dp
        self.ncx = spec.micro * spec.seq_len * cfg.n_embd * stream_bytes(spec)
        self.g, self.r = spec.numerics.gather.nbytes, spec.numerics.reduce.nbytes
        self.stages = stages = pipe.stages_of(rank)
        self.numel = numel
        self.units = _units(spec, stages, self.numel, units)
        self.written: set[int] = set()  # stages whose gradients exist
        # FSDP per stage shards over the shard group: all dp replicas, or S of a mesh R x S
        # (HSDP: the replicate all-reduce sums the reduce-scatter's output in place, no
        # buffer of its own, as in the DP ledger)
        S = self.S = spec.stage_mesh.shard
        if self.units:
            shard = sum(padded(n, S) // S for n in self.units.values())
            self.w.alloc("states", Part.STATES, shard * 3 * FP32)  # parameter, m, v
            for name, n in self._named(None):
                self.w.alloc(f"gathered[{name}]", Part.GATHERED, padded(n, S) * self.g)
        else:
            held = {p for s in stages for p in stage_params(spec, s)}
            self.w.alloc("states", Part.STATES, sum(self.numel[p] for p in held) * 4 * FP32)

    def _named(self, stage: int | None) -> list[tuple[str, int]]:
        return [(name, n) for (s, name), n in self.units.items() if stage in (None, s)]

    def run(self, program: list[Item]) -> MemoryReport:
        last = last_grad_writers(program)
        self.w.measure("step start")
        for item in program:
            for act in item:
                if act.kind in STAGE_COMPUTE:  # while it runs: what it reads, and its scratch
                    self.w.measure(str(act), self.transient(act))
                ACTIONS[act.kind](self, act)
            self.w.measure(" + ".join(str(a) for a in item))
            for act in (a for a in item if last.get(a.stage) == a):
                self.synced(act.stage)
                self.w.measure(f"{act} (its gradients' collective issued)")
        return self.w.report()

    def transient(self, act: Op) -> int:
        """The largest scratch of the stage's layers in this action (a forward's, or a
        backward's: I and W each run half of one, counted as a whole)."""
        assert self.spec.pipeline is not None
        layers = self.spec.pipeline.stages[act.stage].layers
        acts = [layer_acts(self.spec, layer) for layer in layers]
        return max(a.fwd if act.kind is Kind.F else a.bwd for a in acts)

    # -- per action (see the module docstring) -------------------------------------------

    def recv(self, act: Op) -> None:
        kind = "recv_f" if act.kind is Kind.RECV_F else "recv_b"
        self.w.alloc(f"{kind}[s{act.stage}@mb{act.mb}]", Part.ACTS, self.ncx)

    def send(self, act: Op) -> None:
        if act.kind is Kind.SEND_B:
            self.w.free(f"grad_in[s{act.stage}@mb{act.mb}]")

    def forward(self, act: Op) -> None:
        assert self.spec.pipeline is not None
        s, key = act.stage, f"s{act.stage}@mb{act.mb}"
        self.w.free(f"recv_f[{key}]")
        layers = self.spec.pipeline.stages[s].layers
        saved = sum(layer_acts(self.spec, layer).saved for layer in layers)
        if s > 0 and self.pipe.local(s - 1, s):
            saved -= self.ncx  # its input is the local stage before's output, counted there
        above = sum(above_weights(self.spec, layer) for layer in layers)
        self.w.alloc(f"act[{key}]", Part.ACTS, saved - above)
        self.w.alloc(f"loss_side[{key}]", Part.ACTS, above)
        if s < self.pipe.stages - 1:
            self.w.alloc(f"out[{key}]", Part.ACTS, self.ncx)

    def backward(self, act: Op) -> None:
        """B, or I (which keeps the graph for W, and past the first stage the gradients W
        starts from): the input's gradient comes into being."""
        assert self.spec.pipeline is not None
        s, j = act.stage, act.mb
        if s + 1 < self.pipe.stages and self.pipe.local(s + 1, s):
            self.w.free(f"grad_in[s{s + 1}@mb{j}]")  # the local stage after's input gradient
        if act.kind is Kind.B:
            self.weights(act)
        if s > 0:
            self.w.alloc(f"grad_in[s{s}@mb{j}]", Part.ACTS, self.ncx)
        if act.kind is Kind.I and s > 0:
            layers = self.spec.pipeline.stages[s].layers
            stash = sum(weight_grad_stash(self.spec, layer) for layer in layers)
            self.w.free(f"loss_side[s{s}@mb{j}]")
            self.w.alloc(f"stash[s{s}@mb{j}]", Part.ACTS, stash)

    def weights(self, act: Op) -> None:
        """B or W: the stage's saved tensors go; its gradients exist from its first one."""
        key = f"s{act.stage}@mb{act.mb}"
        names = ("act", "loss_side", "out", "recv_b", "stash")
        for name in (f"{part}[{key}]" for part in names):
            self.w.free(name)
        if act.stage not in self.written:
            self.written.add(act.stage)
            for name, n in self._named(act.stage):
                self.w.alloc(f"grad[{name}]", Part.GRADS, padded(n, self.S) * self.g)

    def synced(self, stage: int) -> None:
        """After the stage's last B or W: FSDP frees its gathered units and reduce-scatters
        (the fp32 gradient shard comes into being; the unsharded gradient is held by the
        collective until the update); DDP copies its gradients into its flat buckets."""
        if self.units:
            for name, n in self._named(stage):
                self.w.free(f"gathered[{name}]")
                self.w.alloc(f"shard_grad[{name}]", Part.STATES, padded(n, self.S) // self.S * FP32)
        elif self.dp > 1:
            for k, params in enumerate(stage_buckets(self.spec, stage, self.stages)):
                n = sum(self.numel[p] for p in params)
                self.w.alloc(f"bucket[s{stage}.{k}]", Part.COMM, n * self.r)


ACTIONS = {
    Kind.RECV_F: _RankLedger.recv,
    Kind.RECV_B: _RankLedger.recv,
    Kind.SEND_F: _RankLedger.send,
    Kind.SEND_B: _RankLedger.send,
    Kind.F: _RankLedger.forward,
    Kind.B: _RankLedger.backward,
    Kind.I: _RankLedger.backward,
    Kind.W: _RankLedger.weights,
}


def in_flight(program: list[Item]) -> int:
    """The most micro-batches a rank holds activations for at once: forwards run whose
    backward (B, or W after a split one) has not."""
    live, most = 0, 0
    for item in program:
        for act in item:
            live += act.kind is Kind.F
            live -= act.kind in (Kind.B, Kind.W)
            most = max(most, live)
    return most


def _units(
    spec: Spec, stages: list[int], numel: dict[str, int], places: dict[int, list[int]]
) -> dict[tuple[int, str], int]:
    """FSDP per stage: the rank's units by (stage, name), their parameters' count; the head's
    stage keeps a copy of the tied unit, sharded in the same layout (exec/pipeline.py).
    `places`: each stage's units' places in the spec, whose order they keep."""
    assert spec.pipeline is not None
    units = [spec.pipeline.units[k] for k in sorted(k for s in stages for k in places.get(s, ()))]
    out = {(u.stage, u.name): sum(numel[p] for p in u.params) for u in units}
    for s in stages:
        holds_tied = any(TIED in u.params and u.stage == s for u in units)
        if units and TIED in _stage_held(spec, s, stages) and not holds_tied:
            out[(s, "tied-copy")] = numel[TIED]
    return out


def _stage_held(spec: Spec, stage: int, stages: list[int]) -> list[str]:
    """The parameters a rank keeps for one of its stages: the head's stage's tied wte is a
    copy of its own only where the rank does not hold the embed's stage too (one parameter)."""
    held = stage_params(spec, stage)
    if stage != 0 and 0 in stages:
        held = [p for p in held if p != TIED]
    return held


def stage_buckets(spec: Spec, stage: int, stages: list[int]) -> list[list[str]]:
    """DDP per stage: the stage's buckets on a rank holding `stages`, each the parameters
    its flat copy holds in launch order (the executor's `rank_buckets`, ir/spec.py); one a
    stage without a ddp block's buckets. What the ledger counts and passes/pipeline_bind.py
    binds."""
    assert spec.pipeline is not None
    held = _stage_held(spec, stage, stages)
    if not spec.pipeline.buckets:
        return [held]
    tied_copy = stage != 0 and TIED in held
    buckets = tuple(b.params for b in spec.pipeline.buckets if b.stage == stage)
    return rank_buckets(spec.model, buckets, set(held), tied_copy)


def check_budget(spec: Spec, memory: dict[int, MemoryReport], diag: Diagnostics) -> None:
    """[memory-budget]: each pipeline rank's predicted peak against the declared budget,
    the worst rank said (its global ranks: every replica holds the same)."""
    if spec.memory is None:
        return
    over = {r: m for r, m in memory.items() if m.peak > spec.memory}
    if not over:
        return
    r, m = max(over.items(), key=lambda kv: kv[1].peak)
    dp = spec.dp
    ranks = f"rank {r}" if dp == 1 else f"ranks {r * dp} .. {r * dp + dp - 1}"
    parts = ", ".join(f"{name} {fmt_bytes(v)}" for name, v in m.parts)
    others = f" ({len(over) - 1} more pipeline ranks over)" if len(over) > 1 else ""
    hint = "raise `memory`"
    if m.largest == Part.ACTS.value:
        hint = (
            "fewer micro-batches in flight: 1f1b keeps at most p - r on rank r where gpipe "
            "keeps all of them; or more stages, a smaller `micro`, or raise `memory`"
        )
    elif spec.dp > 1 and spec.pipeline is not None and not spec.pipeline.units:
        hint = "shard each stage over its replicas (an `fsdp { }` block), or raise `memory`"
    diag.error(
        "memory-budget",
        f"predicted peak {fmt_bytes(m.peak)} on pipeline {ranks} (at {m.peak_at}) exceeds "
        f"the budget of {fmt_bytes(spec.memory)}{others}; the largest part is {m.largest} "
        f"({parts})",
        spec.where.get("memory"),
        hint=hint,
    )
