"""What a compute segment calls: its layers as eager torch, or compiled (`compile on`).

Compilation is regional, as torchtitan compiles each TransformerBlock (`apply_compile`):
the executor keeps its cut (every segment's input is a detached leaf, every segment's
backward its own autograd.backward call), and inside a segment torch.compile sees one
ordinary forward, whose backward AOTAutograd compiles with it.

- A segment of one transformer block calls that block through `torch.compile(block)`.
  Every block runs the same code on same-shaped tensors, and dynamo lifts parameters to
  graph inputs, so the first block's graph serves them all: one compile per worker, not
  one per layer (measured: 108 s for the first nano block on a loaded 2-core CPU, 0.4 s
  for the second).
- A run of layers that fuse.py groups into one segment (nothing in the plan separates
  them), or the embedding or the head alone, is one region: `forward_range(first, last)`
  compiled as a whole, so inductor fuses across block boundaries the way a whole-model
  compile does. Regions share forward_range's code, and dynamo compiles it once per range
  (a guard on the names), so the recompile limit is raised to hold every range a plan has.

Shapes are static (`dynamic=False`): every micro-step of a run has the same shape, and a
dynamic graph would be slower for nothing. Autocast (`precision`) is traced into the
graph; fp32 and bf16 compile separately. The backend is inductor;
SCHEDC_COMPILE_BACKEND names another (`aot_eager`: dynamo and AOTAutograd without code
generation, which checks the cut in seconds instead of minutes on a CPU).

A configuration that cannot compile (no C++ compiler for inductor on a CPU, a Python
dynamo does not support, an op it cannot trace) fails on the segment's first call with
one line that names the layers and says `--compile off` avoids it, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from schedc.model.gpt2 import GPT

BACKEND_ENV = "SCHEDC_COMPILE_BACKEND"

Region = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class CompileFailed(Exception):
    """torch.compile could not compile a segment (a message for the user)."""


class Regions:
    """The callable for each segment (first .. last layer), made once and kept."""

    def __init__(self, model: GPT, compile: bool, backend: str | None = None):
        self.model, self.compile = model, compile
        self.backend = backend or os.environ.get(BACKEND_ENV, "inductor")
        self.fns: dict[tuple[str, str], Region] = {}
        self.first_call: set[tuple[str, str]] = set()  # compiled, not yet run once
        self._block = None  # the compiled Block.forward every block segment shares
        if compile:
            n = len(model.config.layers)
            cfg = torch._dynamo.config
            # every range a plan can hold, for the forward_range regions (a few per plan)
            cfg.recompile_limit = max(cfg.recompile_limit, 2 * n + 8)

    def __call__(self, first: str, last: str) -> Region:
        key = (first, last)
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = self._make(first, last)
        if key in self.first_call:
            return self._guarded(key, fn)
        return fn

    def _make(self, first: str, last: str) -> Region:
        model = self.model
        if not self.compile:
            return lambda x, y: model.forward_range(first, last, x, y)
        self.first_call.add((first, last))
        try:
            if first == last and first.startswith("h."):
                block = model.h[model.config.layer_index(first) - 1]
                compiled = torch.compile(block, fullgraph=True, dynamic=False, backend=self.backend)
                return lambda x, y: compiled(x)
            region = torch.compile(
                model.forward_range, fullgraph=True, dynamic=False, backend=self.backend
            )
            return lambda x, y: region(first, last, x, y)
        except Exception as e:  # noqa: BLE001 - torch.compile refuses this platform
            raise CompileFailed(self._why(first, last, e)) from None

    def _guarded(self, key: tuple[str, str], fn: Region) -> Region:
        """The first call compiles: a failure there is the compiler's, and is said so."""

        def first(x, y):
            try:
                out = fn(x, y)
            except (torch._dynamo.exc.TorchDynamoException, _inductor_error()) as e:
                raise CompileFailed(self._why(*key, e)) from None
            self.first_call.discard(key)
            return out

        return first

    def _why(self, first: str, last: str, e: BaseException) -> str:
        what = f"layer {first}" if first == last else f"layers {first} .. {last}"
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
        return (
            f"compile on: torch.compile (backend {self.backend}) failed on "
            f"{what}: {type(e).__name__}: {text}; run with --compile off (or `compile off` "
            "in the schedule) to train uncompiled"
        )


def _inductor_error() -> type[BaseException]:
    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # pragma: no cover - older torch
        return torch._dynamo.exc.TorchDynamoException
    return InductorError


def set_tf32(device: torch.device, tf32: bool | None) -> bool:
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (None: on, as a
    trainer's users expect). Returns whether TF32 is on.

    Only the CUDA switches are touched. On a CPU there is no TF32, and the process-wide
    `torch.set_float32_matmul_precision` is left alone: in torch 2.13 'high' left CPU
    fp32 matmuls bitwise unchanged here, but 'medium' did not (it lets oneDNN use bf16),
    and the suite's CPU equivalence must not depend on which a previous run set.
    """
    if device.type != "cuda":
        return False
    on = tf32 is not False
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on
