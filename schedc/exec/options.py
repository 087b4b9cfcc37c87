"""What an executor is given and gives back: the job (`Comm`), the options (`RunOptions`,
with enums for its modes) and each step's result (`StepStats`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from schedc.errors import RunError
from schedc.ir.spec import Dtype

T = TypeVar("T")


class Device(str, Enum):
    """Where a run trains: `auto` is cuda when torch sees a GPU (one per rank), else cpu."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class NonFinite(str, Enum):
    """A non-finite loss or gradient norm: stop the run, or skip that update and say so."""

    STOP = "stop"
    SKIP = "skip"


class Collectives(str, Enum):
    """The stream groups' backend on CUDA: NCCL, or gloo (several ranks on one GPU, tests)."""

    NCCL = "nccl"
    GLOO = "gloo"


@dataclass
class Comm:
    """This process's place in the job: rank, world, the store and the group for extras."""

    rank: int
    world: int
    group: object | None = None  # None: the default (world) group
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    tag: str = "run"  # names this job's stream groups in the store (one per executor)

    @classmethod
    def from_env(cls, backend: str, timeout_s: float) -> Comm:
        """torchrun's environment (RANK, WORLD_SIZE, ...), or a one-process world without it."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if "RANK" in os.environ:
                try:
                    dist.init_process_group(backend, timeout=timeout)
                except dist.DistError as e:  # a rank that never joined (it failed first)
                    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    raise RunError(
                        f"the job's {os.environ.get('WORLD_SIZE', '?')} ranks did not all "
                        f"join within --timeout {timeout_s:g}s ({why}); a rank that failed "
                        "before joining says why in its own output"
                    ) from None
            else:
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
        return cls(dist.get_rank(), dist.get_world_size(), None, timeout)

    def gather(self, mine: T) -> list[T]:
        """Every rank's `mine`, in rank order (all_gather_object; none at world 1)."""
        if self.world == 1:
            return [mine]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        return every


@dataclass
class RunOptions:
    device: Device = Device.AUTO
    timeout_s: float = 300.0
    trace: bool = False
    dtype: torch.dtype = torch.float32
    record: bool = False  # keep full gradients and parameters of each step (tests)
    log: bool = True
    nonfinite: NonFinite = NonFinite.STOP
    collectives: Collectives = Collectives.NCCL
    # wait for the device at the end of every step; off, only the plan's events and the
    # step start order one step after the other (tests that nothing else is needed)
    sync_each_step: bool = True
    heap: bool = False  # CPU: measure each step's peak live heap (schedc/exec/heap.py)
    # FSDP: measure the gathered and unsharded-gradient peaks from the buffers after every
    # gather and backward (`memory()`); off, a step spends no host time on it
    measure: bool = True
    probe: bool = False  # with trace: time each collective kind first (exec/probe.py)
    # record every buffer the executor allocates, frees, hands to a collective and gets
    # back, by step and instruction (`Executor.buffer_log`; tests hold it against the plan's
    # lifetimes, ir/effects.py)
    log_buffers: bool = False

    def __post_init__(self):  # the modes may be given by their names
        self.device = Device(self.device)
        self.nonfinite = NonFinite(self.nonfinite)
        self.collectives = Collectives(self.collectives)


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    dt_ms: float
    tokens_per_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per collective, this rank
    skipped: str = ""  # why this step's update was skipped (--nonfinite skip)
    issue_ms: float = 0.0  # host time from the step's start until its update was enqueued
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


TORCH_DTYPES = {Dtype.FP32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.FP16: torch.float16}


def pick_device(device: Device | str) -> torch.device:
    """The rank's device: `auto` is its own GPU (LOCAL_RANK's) when this node has one for
    every rank it runs, else the CPU (`auto_note` says why)."""
    device = Device(device)
    if device is Device.AUTO:
        device = Device.CUDA if gpus_for_every_rank() else Device.CPU
    if device is Device.CUDA:
        if not torch.cuda.is_available():
            raise RunError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def local_world() -> int:
    """The ranks this node runs (torchrun's LOCAL_WORLD_SIZE; 1 alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpus_for_every_rank() -> bool:
    return torch.cuda.is_available() and local_world() <= torch.cuda.device_count()


def auto_note(asked: Device | str, device: torch.device) -> str:
    """Why `--device auto` trains on the CPU of a node that has GPUs: fewer than its ranks
    (a one-GPU machine running a world-2 schedule), which NCCL cannot share."""
    if Device(asked) is not Device.AUTO or device.type != "cpu" or not torch.cuda.is_available():
        return ""
    n = torch.cuda.device_count()
    return (
        f"--device auto: cpu, as this node runs {local_world()} ranks and has {n} "
        f"GPU{'s' if n != 1 else ''} (--device cuda needs one a rank)"
    )
