"""Saving and loading a checkpoint: complete or absent, verified before use (the package
docstring says how). Imported only by runs that save or resume: DCP takes a second to import.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from schedc.exec.checkpoint.dcp_metadata import SafeReader
from schedc.exec.checkpoint.files import find, mac
from schedc.exec.checkpoint.layout import FORMAT, HMAC_FILE, CheckpointError, step_dir
from schedc.exec.checkpoint.meta_json import verify
from schedc.exec.checkpoint.state import (
    executor_state,
    load_executor_state,
    unit_params,
    unit_sizes,
)
from schedc.ir.spec import Strategy
from schedc.model.arch import GPTConfig

CRASH_ENV = "SCHEDC_CRASH_AT"  # test hook: die (SIGKILL) at a named point of a save


# -- saving -------------------------------------------------------------------------------------


def save(ex, root: str | os.PathLike, keep: int = 2, key: bytes | None = None) -> Path:
    """Write the executor's state after `ex.step_index` steps; every rank calls this. With a
    key, meta.json.hmac authenticates meta.json (and through its hashes, every file)."""
    root = Path(root)
    rank, name = ex.comm.rank, step_dir(ex.step_index)
    final, tmp = root / name, root / f".{name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(ex)
    _crash_point("before-write", rank, ex.step_index)
    dcp.save(executor_state(ex), checkpoint_id=str(tmp), process_group=ex.comm.group)
    # every rank's CPU RNG state, in rank order
    rng = ex.comm.gather(base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())
    _crash_point("after-write", rank, ex.step_index)
    if rank == 0:
        _write_meta(ex, tmp, rng, key)
        _crash_point("before-rename", rank, ex.step_index)
        _publish(tmp, final, keep)
    _barrier(ex)
    return final


def _write_meta(ex, tmp: Path, rng: list[str], key: bytes | None) -> None:
    """meta.json over the files DCP wrote (and its HMAC, with a key), all on disk."""
    meta = {
        "format": FORMAT,
        "step": ex.step_index,
        "world": ex.comm.world,
        "strategy": ex.spec.sync,  # a pipeline's per stage: its form is DP's
        "model": ex.spec.model_name,
        "model_config": dataclasses.asdict(ex.spec.model),
        "schedule_sha256": hashlib.sha256(ex.compiled.source.text.encode()).hexdigest(),
        "units": unit_sizes(ex),
        "unit_params": unit_params(ex),
        "rng": rng,
        "stream": _stream(ex),
        "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir())},
    }
    text = json.dumps(meta, indent=1)
    _write_atomic(tmp / "meta.json", text)
    if key is not None:
        _write_atomic(tmp / HMAC_FILE, mac(key, text.encode()) + "\n")
    _fsync_dir(tmp)


def _stream(ex) -> dict:
    """Where the run is in its token stream, and the LR schedule it is on (meta_json._stream):
    a resume must continue both, not start another."""
    spec = ex.spec
    return {
        "data": ex.batches.fingerprint(),
        "sequences": ex.step_index * spec.seqs,
        "lr_horizon": spec.optim.horizon(spec.steps),
    }


def _publish(tmp: Path, final: Path, keep: int) -> None:
    """Rename the written checkpoint into place, name it in `latest`, drop the oldest
    beyond `keep`; each step durable before the next."""
    root = final.parent
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _crash_point("before-latest", 0)  # rank 0 publishes
    _write_atomic(root / "latest", final.name + "\n")
    _fsync_dir(root)
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _crash_point(where: str, rank: int, step: int | None = None) -> None:
    """Die here, as a SIGKILL would, when a test asks for it
    (SCHEDC_CRASH_AT=where[@rank][#step]: at the save of that step only)."""
    want, _, at = os.environ.get(CRASH_ENV, "").partition("#")
    point, _, who = want.partition("@")
    if point == where and (not who or int(who) == rank) and (not at or int(at) == step):
        os.kill(os.getpid(), 9)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _barrier(ex) -> None:
    if ex.comm.world > 1:
        dist.barrier(group=ex.comm.group)


# -- resuming -----------------------------------------------------------------------------------


def load(ex, root: str | os.PathLike, key: bytes | None = None) -> int:
    """Restore the executor from a checkpoint; returns the step to continue from. Every
    failure is a CheckpointError naming the file."""
    path = find(root)
    meta = verify(path, key)
    _check_same_schedule(ex, path, meta)
    SafeReader(str(path), meta).read_metadata()  # refuse bad metadata before DCP touches it
    _check_same_stream(ex, path, meta)
    state = executor_state(ex)
    _dcp_load(path, meta, state, ex.comm.group)
    step = meta["step"]
    load_executor_state(ex, state, step)
    rng = meta["rng"]
    if len(rng) == ex.comm.world:
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(rng[ex.comm.rank])), dtype=torch.uint8)
        )
    ex.step_index = step
    return step


def _check_same_schedule(ex, path: Path, meta: dict) -> None:
    """The checkpoint was saved by a schedule of this strategy and model (and, for FSDP,
    these units): its tensors fit this executor's."""
    spec = ex.spec
    fsdp = (meta["strategy"] == Strategy.FSDP, spec.sync is Strategy.FSDP)
    if fsdp[0] != fsdp[1] or meta["model_config"] != dataclasses.asdict(spec.model):
        # a DDP, one-process or pipeline (DDP per stage) run saves every parameter whole by
        # name, so each resumes the others; FSDP saves flat units
        raise CheckpointError(
            f"{path}: saved by a {meta['strategy']} schedule of model {meta['model']}; this is a "
            f"{spec.sync} schedule of model {spec.model_name}"
        )
    ours = unit_sizes(ex)
    if spec.sync is Strategy.FSDP and meta["units"] != ours:
        diff = sorted(set(meta["units"]) ^ set(ours)) or sorted(
            f"{u} ({meta['units'][u]} elements saved, {n} here)"
            for u, n in ours.items()
            if meta["units"][u] != n
        )
        raise CheckpointError(
            f"{path}: its FSDP units differ from this schedule's: {', '.join(map(str, diff))}"
        )
    saved = meta.get("unit_params")  # format 1 did not record them
    if spec.sync is Strategy.FSDP and saved is not None and saved != unit_params(ex):
        # units of the same sizes holding other parameters, or in another order, would load
        # without an error and train on scrambled weights
        raise CheckpointError(
            f"{path}: its FSDP units hold other parameters than this schedule's "
            "(of the same sizes: another partition, or another order)"
        )


def _check_same_stream(ex, path: Path, meta: dict) -> None:
    """The resumed run reads on where the saved one stopped, in the same token stream, on
    the same LR schedule; else it would train on other tokens, or at other rates, silently."""
    if "stream" not in meta:
        return  # format 1: saved before checkpoints recorded their stream
    saved, here = meta["stream"], _stream(ex)
    here["sequences"] = meta["step"] * ex.spec.seqs
    if saved["data"] != here["data"]:
        raise CheckpointError(
            f"{path}: saved while reading data {saved['data']}; this run reads "
            f"{here['data']} ({ex.spec.data.source}): a resume continues the same token "
            "stream (the same files, in the same order)"
        )
    if saved["sequences"] != here["sequences"]:
        raise CheckpointError(
            f"{path}: saved after {saved['sequences']:,} sequences of the data stream; "
            f"step {meta['step']} of this schedule ({ex.spec.seqs} a step) would start at "
            f"{here['sequences']:,}: resume with the global batch it was saved with"
        )
    old, n = saved["lr_horizon"], here["lr_horizon"]
    if old != n and (d := first_lr_difference(ex.spec.optim, meta["step"], old, n)) is not None:
        opt = ex.spec.optim
        raise CheckpointError(
            f"{path}: saved on an LR schedule that decays over {old} steps; this run's "
            f"decays over {n} (lr at step {d}: {opt.lr_at(d, n):.4e}, not "
            f"{opt.lr_at(d, old):.4e}); resume with --steps {old}, or fix the horizon in "
            f"the file (`decay_steps = {old}` in the optimizer) to stop elsewhere"
        )


def first_lr_difference(opt, step: int, a: int, b: int) -> int | None:
    """The first step from `step` on whose learning rate differs between decay horizons `a`
    and `b` (in warmup they agree, and past both horizons too): None if none does."""
    return next(
        (s for s in range(step, max(a, b, opt.warmup) + 1) if opt.lr_at(s, a) != opt.lr_at(s, b)),
        None,
    )


def _dcp_load(path: Path, meta: dict, state: dict[str, torch.Tensor], group=None) -> None:
    """DCP reads the tensors into `state`, through SafeReader, on the ranks of `group` (None
    and no process group: this process alone); whatever fails is a CheckpointError about this
    checkpoint."""
    alone = not dist.is_initialized()
    try:
        reader = SafeReader(str(path), meta)
        with warnings.catch_warnings():  # alone, DCP warns that it assumes what was asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, process_group=group, no_dist=alone)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's errors are about this checkpoint
        cause = _cause(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        what = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
        raise CheckpointError(f"{path}: cannot be loaded: {what}") from None


# -- reading the parameters in one process (schedc export) ---------------------------------------


def read_parameters(
    root: str | os.PathLike, key: bytes | None = None
) -> tuple[dict, GPTConfig, dict[str, torch.Tensor]]:
    """A checkpoint's parameters, whole and by name, read in this process alone whatever
    world saved it (DCP joins a sharded unit's chunks): its meta.json, its model, and the
    parameters. Checked as a resume checks it: HMAC with a key, meta.json, every file's hash,
    DCP's metadata; only parameters are read, never the optimizer's moments."""
    path = find(root)
    meta = verify(path, key)
    items = SafeReader(str(path), meta).read_metadata().state_dict_metadata
    model = GPTConfig(**meta["model_config"])  # meta_json checked it is one
    units = meta.get("unit_params")
    if units is None and meta["units"]:
        raise CheckpointError(
            f"{path}: a format-1 FSDP checkpoint does not say which parameters each unit "
            "holds; resume it with `schedc run --resume` and save again to export it"
        )
    shapes: dict[str, tuple[int, ...]] = {
        f"unit.{u}.param": (n,) for u, n in meta["units"].items()
    } or {f"param.{p.name}": p.shape for p in model.params}
    state = {}
    for n, shape in shapes.items():
        item = items.get(n)  # SafeReader admitted tensor items only
        if not isinstance(item, TensorStorageMetadata) or tuple(item.size) != shape:
            raise CheckpointError(
                f"{path}: holds no {n} of shape {shape}, which its meta.json promises"
            )
        state[n] = torch.empty(shape, dtype=item.properties.dtype)
    _dcp_load(path, meta, state)
    if not units:
        return meta, model, {n.removeprefix("param."): t for n, t in state.items()}
    params = {}
    for u, held in units.items():
        flat = state[f"unit.{u}.param"]
        for name, part in zip(held, flat.split([model.param(n).numel for n in held])):
            params[name] = part.view(model.param(name).shape)
    return meta, model, params


def _cause(e: BaseException) -> BaseException:
    """What failed: DCP wraps the ranks' failures in a CheckpointException (a BaseException);
    the first of them."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e
