"""Checkpoints that lose nothing: complete or absent, verified before use, safe to load.

    DIR/step_00000040/      one checkpoint: torch.distributed.checkpoint files + meta.json
    DIR/latest              the name of the newest complete checkpoint

What is saved: every parameter and its AdamW state, the step (which fixes the learning
rate and the data position: step s reads global batch s), and each rank's RNG state.
FSDP saves each unit's flat parameter and moments as a DTensor sharded on dim 0 over the
unpadded length, which is exactly how its shards lie; a resume at another world size
lets DCP reshard them. DDP state is replicated, and DCP writes it once.

Complete or absent: a checkpoint is written into a hidden temporary directory, hashed
(meta.json lists the SHA-256 of every file), fsynced, renamed into place, and only then
named by `latest` (written by rename too). A crash at any point leaves the previous
checkpoint untouched; a truncated or altered file fails the hash check with a clear
error. Loading never runs code from the checkpoint: hashes are checked first, tensors are
read with torch.load(weights_only=True), and DCP's pickled metadata is read by an
unpickler that admits only DCP's own metadata classes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

from schedc.ir.spec import Strategy

FORMAT = 1
CRASH_ENV = "SCHEDC_CRASH_AT"  # test hook: die (SIGKILL) at a named point of a save


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, altered or for another schedule."""


# -- state <-> executor -------------------------------------------------------------------------


def executor_state(ex) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments, keyed by name, in a form that does not depend on D."""
    state: dict[str, torch.Tensor] = {}
    opt = ex.optimizer
    if ex.units:
        from torch.distributed.tensor import DTensor, Shard

        mesh = _mesh(ex)
        for u in ex.units.values():
            local = u.shard[: _kept(u)]
            parts = [p for group in u.optimizer_params() for p in group]
            st = [opt.state.get(p, {}) for p in parts]
            m = torch.cat([s.get("exp_avg", torch.zeros(p.numel())) for s, p in zip(st, parts)]
                          ) if parts else local.new_zeros(0)
            v = torch.cat([s.get("exp_avg_sq", torch.zeros(p.numel())) for s, p in zip(st, parts)]
                          ) if parts else local.new_zeros(0)
            for key, t in (("param", local), ("exp_avg", m), ("exp_avg_sq", v)):
                state[f"unit.{u.name}.{key}"] = DTensor.from_local(
                    t.contiguous(), mesh, [Shard(0)], run_check=False,
                    shape=torch.Size([u.numel]), stride=(1,))
        return state
    for name, p in ex.params.items():
        state[f"param.{name}"] = p.detach()
        s = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{name}.{key}"] = s.get(key, torch.zeros_like(p))
    return state


def load_executor_state(ex, state: dict[str, torch.Tensor], step: int) -> None:
    opt = ex.optimizer
    step_t = lambda: torch.tensor(float(step))  # noqa: E731  (AdamW keeps step as a tensor)
    if ex.units:
        for u in ex.units.values():
            n = _kept(u)
            u.shard[:n].copy_(state[f"unit.{u.name}.param"].to_local())
            m = state[f"unit.{u.name}.exp_avg"].to_local()
            v = state[f"unit.{u.name}.exp_avg_sq"].to_local()
            off = 0
            for p in (p for group in u.optimizer_params() for p in group):
                k = p.numel()
                if step > 0:
                    opt.state[p] = {"step": step_t(),
                                                "exp_avg": m[off : off + k].clone(),
                                                "exp_avg_sq": v[off : off + k].clone()}
                off += k
        return
    with torch.no_grad():
        for name, p in ex.params.items():
            p.copy_(state[f"param.{name}"])
            if step > 0:
                opt.state[p] = {"step": step_t(),
                                "exp_avg": state[f"optim.{name}.exp_avg"].clone(),
                                "exp_avg_sq": state[f"optim.{name}.exp_avg_sq"].clone()}


def _kept(u) -> int:
    """The unpadded part of this rank's shard (torch.chunk's split: the last may be short)."""
    return max(0, min(u.shard_len, u.numel - u.rank * u.shard_len))


def _mesh(ex):
    from torch.distributed.device_mesh import DeviceMesh

    group = ex.comm.group or dist.distributed_c10d._get_default_group()
    return DeviceMesh.from_group(group, ex.device.type)


# -- saving -------------------------------------------------------------------------------------


def save(ex, root: str | os.PathLike, keep: int = 2) -> Path:
    """Write the executor's state after `ex.step_index` steps; every rank calls this."""
    root = Path(root)
    step, rank, group = ex.step_index, ex.comm.rank, ex.comm.group
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(ex)
    _crash_point("before-write", rank)
    dcp.save(executor_state(ex), checkpoint_id=str(tmp), process_group=group)
    rng = [None] * ex.comm.world
    mine = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    if ex.comm.world > 1:
        dist.all_gather_object(rng, mine, group=group)
    else:
        rng = [mine]
    _crash_point("after-write", rank)
    if rank == 0:
        meta = {"format": FORMAT, "step": step, "world": ex.comm.world,
                "strategy": ex.spec.kind, "model": ex.spec.model_name,
                "model_config": dataclasses.asdict(ex.spec.model),
                "schedule_sha256": hashlib.sha256(ex.compiled.source.text.encode()).hexdigest(),
                "units": {u.name: u.numel for u in ex.units.values()},
                "rng": rng, "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir())}}
        _write_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        _crash_point("before-rename", rank)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _crash_point("before-latest", rank)
        _write_atomic(root / "latest", name + "\n")
        _fsync_dir(root)
        for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(ex)
    return final


def _crash_point(where: str, rank: int) -> None:
    """Die here, as a SIGKILL would, when a test asks for it (SCHEDC_CRASH_AT=where[@rank])."""
    want = os.environ.get(CRASH_ENV, "")
    point, _, who = want.partition("@")
    if point == where and (not who or int(who) == rank):
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


# -- loading ------------------------------------------------------------------------------------


def find(root: str | os.PathLike) -> Path:
    """The checkpoint to resume from: `root` itself, or the one `root/latest` names."""
    root = Path(root)
    if (root / "meta.json").exists():
        return root
    latest = root / "latest"
    if not latest.exists():
        if not root.exists():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        raise CheckpointError(f"{root}: no complete checkpoint here (no 'latest' file)")
    path = root / latest.read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path}: named by {latest} but incomplete (no meta.json)")
    return path


def verify(path: Path) -> dict:
    """Read meta.json and check every file's hash; no checkpoint byte is trusted before."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/meta.json is unreadable: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, expected {FORMAT}")
    for fname, want in meta["files"].items():
        f = path / fname
        if not f.exists():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        if _sha256(f) != want:
            raise CheckpointError(f"{f}: contents do not match the checkpoint's hash (truncated "
                                  "or altered)")
    return meta


def load(ex, root: str | os.PathLike) -> int:
    """Restore the executor from a checkpoint; returns the step to continue from."""
    path = find(root)
    meta = verify(path)
    spec = ex.spec
    if meta["strategy"] != spec.kind or meta["model_config"] != dataclasses.asdict(spec.model):
        raise CheckpointError(
            f"{path}: saved by a {meta['strategy']} schedule of model {meta['model']}; this is a "
            f"{spec.kind} schedule of model {spec.model_name}")
    if spec.kind is Strategy.FSDP and meta["units"] != {u.name: u.numel for u in ex.units.values()}:
        raise CheckpointError(f"{path}: its FSDP units {sorted(meta['units'])} differ from this "
                              f"schedule's {sorted(u.name for u in ex.units.values())}")
    SafeReader(str(path)).read_metadata()  # refuse bad metadata before DCP touches it
    state = executor_state(ex)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), process_group=ex.comm.group)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - anything DCP raises is about this checkpoint
        raise CheckpointError(f"{path}: cannot be loaded: {e}") from None
    step = int(meta["step"])
    load_executor_state(ex, state, step)
    rng = meta["rng"]
    if len(rng) == ex.comm.world:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng[ex.comm.rank])),
                                             dtype=torch.uint8))
    ex.step_index = step
    return step


class SafeReader(FileSystemReader):
    """DCP's file reader, but its pickled metadata may only name DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path}: refused: {e}") from None
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    ALLOWED_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
    ALLOWED = {("torch", "Size"), ("torch", "float32"), ("torch", "float64"), ("torch", "float16"),
               ("torch", "bfloat16"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"),
               ("torch", "bool"), ("torch", "strided"), ("torch", "contiguous_format"),
               ("torch", "preserve_format"), ("collections", "OrderedDict"),
               ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("pathlib", "Path")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or module.startswith(self.ALLOWED_MODULES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"metadata names {module}.{name}, which a DCP checkpoint "
                                     "never does")
