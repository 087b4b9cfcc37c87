"""Checkpoints that lose nothing: complete or absent, verified before use, safe to load.

    DIR/step_00000040/      one checkpoint: torch.distributed.checkpoint files + meta.json
                            (+ meta.json.hmac when saved with --checkpoint-key)
    DIR/latest              the name of the newest complete checkpoint

What is saved: every parameter and its AdamW state, the step (which fixes the learning
rate and the data position: step s reads global batch s), and each rank's RNG state.
FSDP saves each unit's flat parameter and moments as a DTensor sharded on dim 0 over the
unpadded length, which is exactly how its shards lie; a resume at another world size
lets DCP reshard them. DDP state is replicated, and DCP writes it once.

Complete or absent: a checkpoint is written into a hidden temporary directory, hashed
(meta.json lists the SHA-256 of every file), fsynced, renamed into place, and only then
named by `latest` (written by rename too). A crash at any point leaves the previous
checkpoint untouched.

What the hashes promise: the SHA-256 list detects corruption and truncation, not
tampering. It lives in meta.json beside the files it covers, so whoever can write the
directory can rewrite a tensor file and its hash, and without a key that is undetectable.
Tamper evidence needs a secret: with `--checkpoint-key FILE` (16 to 4096 bytes, e.g.
`head -c 32 /dev/urandom > FILE`), save writes meta.json.hmac, the HMAC-SHA256 of
meta.json's exact bytes, and load checks it before reading anything else; since
meta.json holds every file's hash, the HMAC covers every byte. A key proves that a
holder of the key wrote that checkpoint, not that it is the newest one. A checkpoint
that has meta.json.hmac is refused without a key (never loaded unchecked); a key and no
meta.json.hmac is refused too.

Loading never runs code from the checkpoint, keyed or not: every path stays inside the
checkpoint directory and every file read is a regular file (no link, FIFO or device);
meta.json is checked field by field; tensors are read with torch.load(weights_only=True);
DCP's pickled metadata is read by an unpickler that admits an exact list of classes, and
a metadata that declares anything but tensors is refused. Every failure is a
CheckpointError naming the file.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import hmac
import importlib
import io
import json
import math
import os
import pickle
import re
import shutil
import stat
import zipfile
from pathlib import Path, PosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from schedc.errors import UserError
from schedc.ir.spec import Strategy

FORMAT = 1
CRASH_ENV = "SCHEDC_CRASH_AT"  # test hook: die (SIGKILL) at a named point of a save


class CheckpointError(UserError):
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
            m, v = (unit_moment(opt, parts, key, local) for key in ("exp_avg", "exp_avg_sq"))
            for key, t in (("param", local), ("exp_avg", m), ("exp_avg_sq", v)):
                state[f"unit.{u.name}.{key}"] = DTensor.from_local(
                    t.contiguous(),
                    mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=torch.Size([u.numel]),
                    stride=(1,),
                )
        return state
    for name, p in ex.params.items():
        state[f"param.{name}"] = p.detach()
        s = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{name}.{key}"] = s.get(key, torch.zeros_like(p))
    return state


def unit_moment(opt, parts, key: str, local: torch.Tensor) -> torch.Tensor:
    """One AdamW moment of a unit's shard, flat: the optimizer's where it has one, zeros where
    it has none yet (before the first update, and the template a resume loads into).

    The zeros are made on the parameter's device and in its dtype: a resume on CUDA loads into
    this template and hands its slices to AdamW, which refuses moments on another device
    than their parameter (FSDP2's sharded state lives on the parameter's device too)."""
    if not parts:
        return local.new_zeros(0)
    return torch.cat(
        [opt.state.get(p, {}).get(key, torch.zeros_like(p).reshape(-1)) for p in parts]
    )


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
                if step > 0:  # on the parameter's device, whatever DCP loaded into
                    opt.state[p] = {
                        "step": step_t(),
                        "exp_avg": m[off : off + k].to(p.device, p.dtype, copy=True),
                        "exp_avg_sq": v[off : off + k].to(p.device, p.dtype, copy=True),
                    }
                off += k
        return
    with torch.no_grad():
        for name, p in ex.params.items():
            p.copy_(state[f"param.{name}"])
            if step > 0:
                opt.state[p] = {
                    "step": step_t(),
                    "exp_avg": state[f"optim.{name}.exp_avg"].clone(),
                    "exp_avg_sq": state[f"optim.{name}.exp_avg_sq"].clone(),
                }


def _kept(u) -> int:
    """The unpadded part of this rank's shard (torch.chunk's split: the last may be short)."""
    return max(0, min(u.shard_len, u.numel - u.rank * u.shard_len))


def _mesh(ex):
    from torch.distributed.device_mesh import DeviceMesh

    group = ex.comm.group or dist.distributed_c10d._get_default_group()
    return DeviceMesh.from_group(group, ex.device.type)


# -- saving -------------------------------------------------------------------------------------


def save(ex, root: str | os.PathLike, keep: int = 2, key: bytes | None = None) -> Path:
    """Write the executor's state after `ex.step_index` steps; every rank calls this. With a
    key, meta.json.hmac authenticates meta.json (and through its hashes, every file)."""
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
        meta = {
            "format": FORMAT,
            "step": step,
            "world": ex.comm.world,
            "strategy": ex.spec.kind,
            "model": ex.spec.model_name,
            "model_config": dataclasses.asdict(ex.spec.model),
            "schedule_sha256": hashlib.sha256(ex.compiled.source.text.encode()).hexdigest(),
            "units": {u.name: u.numel for u in ex.units.values()},
            "rng": rng,
            "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir())},
        }
        text = json.dumps(meta, indent=1)
        _write_atomic(tmp / "meta.json", text)
        if key is not None:
            _write_atomic(tmp / HMAC_FILE, _mac(key, text.encode()) + "\n")
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
#
# Nothing read from a checkpoint is trusted before it is checked, in this order: `latest`
# (a bounded read; it must name a direct child step_NNNNNNNN), the HMAC over meta.json's
# bytes when a key is given, meta.json's schema, every listed file's hash (regular files
# only, opened without following links), then DCP's .metadata: its bytes against their
# hash, unpickled with an exact allowlist, and its structure checked (tensors only, keys
# schedc writes, storage in the checkpoint's own hashed files). Tensor data is read by DCP
# itself; in torch 2.13 FileSystemReader.read_data reads a tensor item with
# torch.load(..., weights_only=True), and only a bytes item (BytesStorageMetadata) goes to
# DefaultLoadPlanner.load_bytes, which calls torch.load(weights_only=False): schedc never
# writes bytes items (the RNG state lives in meta.json), so a metadata that declares one is
# refused before DCP reads anything.

HMAC_FILE = "meta.json.hmac"
MAX_META_BYTES = 32 << 20  # meta.json: 7 KB at world 1 (6.7 KB of it a rank's RNG state)
MAX_METADATA_BYTES = 64 << 20  # DCP's .metadata: 38 KB for the tiny model's 157 tensors
MAX_FILES, MAX_WORLD, MAX_UNITS = 4096, 4096, 4096
RECORD_SLACK = 64 << 10  # a stored chunk's record: its bytes plus torch.save's (1,577 measured)
_STEP = re.compile(r"step_[0-9]{8,12}")
_FILE = re.compile(r"\.metadata|__[0-9]{1,6}_[0-9]{1,6}\.distcp")  # what DCP writes
_ITEM = re.compile(r"(param|optim|unit)\.[A-Za-z0-9_.]{1,200}")  # what executor_state writes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STRATEGIES = ("single", "ddp", "fsdp")


def read_key(path: str | os.PathLike) -> bytes:
    """The secret of --checkpoint-key FILE: the file's bytes (16 to 4096 of them)."""
    key = _read(Path(path), 4096, "a checkpoint key")
    if len(key) < 16:
        raise CheckpointError(
            f"{path}: a checkpoint key needs at least 16 bytes, this has "
            f"{len(key)} (e.g. head -c 32 /dev/urandom > {path})"
        )
    return key


def _mac(key: bytes, data: bytes) -> str:
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


def _open(path: Path) -> int:
    """A descriptor of `path` if it is a regular file. O_NOFOLLOW refuses a symbolic link,
    O_NONBLOCK keeps the open of a FIFO from waiting for a writer, fstat refuses the rest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path}: a symbolic link; a checkpoint holds regular files only"
            ) from None
        raise CheckpointError(f"{path}: cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or directory)")
    return fd


def _read(path: Path, limit: int, what: str = "a checkpoint file") -> bytes:
    fd = _open(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{path}: over {limit} bytes, too large for {what}")
    return data


def _hash_file(path: Path, limit: int | None = None) -> tuple[str, int]:
    """SHA-256 and size of a regular file (never a link, FIFO or device), refused before
    a byte is read when it is larger than `limit` (a sparse file costs nothing to make)."""
    fd = _open(path)
    size = os.fstat(fd).st_size
    if limit is not None and size > limit:
        os.close(fd)
        raise CheckpointError(
            f"{path}: {size} bytes, more than the {limit} a checkpoint of this model can hold"
        )
    h, n = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    return h.hexdigest(), n


def find(root: str | os.PathLike) -> Path:
    """The checkpoint to resume from: `root` itself, or the one `root/latest` names, which
    must be a directory step_NNNNNNNN directly inside `root` (no path, no link out of it)."""
    root = Path(root)
    if (root / "meta.json").exists():
        return root
    latest = root / "latest"
    if not os.path.lexists(latest):
        if not root.exists():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        raise CheckpointError(f"{root}: no complete checkpoint here (no 'latest' file)")
    try:
        name = _read(latest, 64, "'latest'").decode("ascii").strip()
    except UnicodeDecodeError:
        name = "?"
    if not _STEP.fullmatch(name):
        raise CheckpointError(
            f"{latest}: names {name[:40]!r}, not a checkpoint step_NNNNNNNN of this directory"
        )
    path = root / name
    if path.is_symlink() or not path.is_dir() or path.resolve().parent != root.resolve():
        raise CheckpointError(
            f"{latest}: names {path}, which is not a directory inside {root}"
            " (a symbolic link, or missing)"
        )
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path}: named by {latest} but incomplete (no meta.json)")
    return path


def verify(path: Path, key: bytes | None = None) -> dict:
    """Check the HMAC (with a key), meta.json's schema, and every file's hash; no byte of the
    checkpoint is used before. Returns meta.json, with the files' sizes under "_sizes"."""
    meta = read_meta(path, key)
    limit = _largest(meta, path / "meta.json")
    sizes = {}
    for fname, want in meta["files"].items():
        got, sizes[fname] = _hash_file(path / fname, limit)
        if got != want:
            raise CheckpointError(
                f"{path / fname}: contents do not match the checkpoint's hash "
                "(truncated or altered)"
            )
    meta["_sizes"] = sizes
    return meta


def _largest(meta: dict, where: Path) -> int:
    """The most bytes one file of a checkpoint of meta's model can hold: every parameter
    and its two AdamW moments in float64, with room for padding and per-record headers."""
    from schedc.model.arch import GPTConfig

    try:
        numel = GPTConfig(**meta["model_config"]).numel
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: field 'model_config': not a GPT-2 configuration") from None
    return 32 * numel + (64 << 20)


def read_meta(path: Path, key: bytes | None = None) -> dict:
    """meta.json, read as a checkpoint file is (a regular file, at most MAX_META_BYTES),
    its HMAC checked with a key before a byte of it is parsed, then its schema; the files
    it lists are not read (verify does that)."""
    where = path / "meta.json"
    raw = _read(where, MAX_META_BYTES, "meta.json")
    mac = path / HMAC_FILE
    if key is not None:
        if not os.path.lexists(mac):
            raise CheckpointError(
                f"{mac}: missing, so --checkpoint-key cannot check this "
                "checkpoint (saved without a key, or the HMAC was removed)"
            )
        got = _read(mac, 256, "an HMAC").decode("ascii", "replace").strip()
        if not hmac.compare_digest(got, _mac(key, raw)):
            raise CheckpointError(
                f"{mac}: the HMAC of meta.json does not match this key "
                "(another key, or meta.json was altered)"
            )
    elif os.path.lexists(mac):
        raise CheckpointError(
            f"{mac}: this checkpoint was saved with --checkpoint-key; give the same key to load it"
        )
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: not valid JSON: nested too deeply") from None
    _check_meta(meta, where)
    if _STEP.fullmatch(path.name) and path.name != f"step_{meta['step']:08d}":
        raise CheckpointError(
            f"{where}: field 'step': {meta['step']}, but the directory is {path.name} (renamed?)"
        )
    return meta


def _check_meta(meta, where: Path) -> None:
    """meta.json's schema, field by field: exactly the keys save() writes, each of its type
    and in range; files are DCP's own names, directly in the directory."""

    def bad(field: str, what: str):
        raise CheckpointError(f"{where}: field '{field}': {what}")

    def integer(field: str, v, lo: int, hi: int) -> None:
        if type(v) is not int or not lo <= v <= hi:
            bad(field, f"{str(v)[:40]!r} is not an integer in [{lo}, {hi}]")

    if type(meta) is not dict:
        raise CheckpointError(f"{where}: not a JSON object")
    want = {
        "format",
        "step",
        "world",
        "strategy",
        "model",
        "model_config",
        "schedule_sha256",
        "units",
        "rng",
        "files",
    }
    for k in sorted(want - meta.keys()):
        bad(k, "missing")
    for k in sorted(meta.keys() - want):
        bad(k[:40], "not a field of a schedc checkpoint")
    if meta["format"] != FORMAT or type(meta["format"]) is not int:
        bad("format", f"{str(meta['format'])[:20]}, expected {FORMAT}")
    integer("step", meta["step"], 0, 10**12)
    integer("world", meta["world"], 1, MAX_WORLD)
    if meta["strategy"] not in _STRATEGIES:
        bad("strategy", f"{str(meta['strategy'])[:40]!r} is not one of {', '.join(_STRATEGIES)}")
    if type(meta["model"]) is not str or not 0 < len(meta["model"]) <= 100:
        bad("model", "not a model name")
    cfg = meta["model_config"]
    if type(cfg) is not dict or len(cfg) > 64:
        bad("model_config", "not an object of model sizes")
    for k, v in cfg.items():
        integer(f"model_config.{k[:40]}", v, 0, 2**40)
    if type(meta["schedule_sha256"]) is not str or not _HEX64.fullmatch(meta["schedule_sha256"]):
        bad("schedule_sha256", "not a SHA-256 in hex")
    units = meta["units"]
    if type(units) is not dict or len(units) > MAX_UNITS:
        bad("units", f"not an object of at most {MAX_UNITS} unit sizes")
    for k, v in units.items():
        integer(f"units.{k[:40]}", v, 0, 2**48)
    rng = meta["rng"]
    if type(rng) is not list or len(rng) != meta["world"]:
        bad("rng", f"not a list of {meta['world']} RNG states (one a rank)")
    n = torch.get_rng_state().numel()
    for r, state in enumerate(rng):
        try:
            ok = type(state) is str and len(base64.b64decode(state, validate=True)) == n
        except ValueError:
            ok = False
        if not ok:
            bad(f"rng[{r}]", f"not the base64 of a {n}-byte RNG state")
    files = meta["files"]
    if type(files) is not dict or not 0 < len(files) <= MAX_FILES:
        bad("files", f"not an object of 1 to {MAX_FILES} file hashes")
    for fname, h in files.items():
        if not _FILE.fullmatch(fname):
            bad("files", f"{fname[:60]!r} is not a file DCP writes (.metadata, __R_N.distcp)")
        if type(h) is not str or not _HEX64.fullmatch(h):
            bad(f"files[{fname!r}]", "not a SHA-256 in hex")
    if ".metadata" not in files:
        bad("files", "does not list .metadata")


def load(ex, root: str | os.PathLike, key: bytes | None = None) -> int:
    """Restore the executor from a checkpoint; returns the step to continue from. Every
    failure is a CheckpointError naming the file."""
    path = find(root)
    meta = verify(path, key)
    spec = ex.spec
    if meta["strategy"] != spec.kind or meta["model_config"] != dataclasses.asdict(spec.model):
        raise CheckpointError(
            f"{path}: saved by a {meta['strategy']} schedule of model {meta['model']}; this is a "
            f"{spec.kind} schedule of model {spec.model_name}"
        )
    ours = {u.name: u.numel for u in ex.units.values()}
    if spec.kind is Strategy.FSDP and meta["units"] != ours:
        diff = sorted(set(meta["units"]) ^ set(ours)) or sorted(
            f"{u} ({meta['units'][u]} elements saved, {n} here)"
            for u, n in ours.items()
            if meta["units"][u] != n
        )
        raise CheckpointError(
            f"{path}: its FSDP units differ from this schedule's: {', '.join(map(str, diff))}"
        )
    SafeReader(str(path), meta).read_metadata()  # refuse bad metadata before DCP touches it
    state = executor_state(ex)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path), meta), process_group=ex.comm.group)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's errors are about this checkpoint
        if isinstance(e, CheckpointException) and e.failures:  # a BaseException: unwrap
            e = next(iter(e.failures.values()))[0]
            if isinstance(e, CheckpointError):
                raise e from None
        what = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise CheckpointError(f"{path}: cannot be loaded: {what}") from None
    step = meta["step"]
    load_executor_state(ex, state, step)
    rng = meta["rng"]
    if len(rng) == ex.comm.world:
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(rng[ex.comm.rank])), dtype=torch.uint8)
        )
    ex.step_index = step
    return step


class SafeReader(FileSystemReader):
    """DCP's file reader, reading only a checked .metadata: its bytes hashed as meta.json says,
    unpickled with an exact allowlist, its structure what schedc writes (_check_metadata)."""

    def __init__(self, path: str | os.PathLike, meta: dict | None = None):
        super().__init__(path)
        self.meta = meta if meta is not None else verify(Path(path))

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"  # never __R.metadata: schedc does not write those
        data = _read(path, MAX_METADATA_BYTES, "DCP metadata")
        if hashlib.sha256(data).hexdigest() != self.meta["files"][".metadata"]:
            raise CheckpointError(
                f"{path}: contents do not match the checkpoint's hash (changed while loading)"
            )
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed pickle: every kind of error
            raise CheckpointError(
                f"{path}: refused: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}"
            ) from None
        _check_metadata(metadata, path, self.meta["_sizes"], self.meta["world"])
        _check_records(metadata, Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_metadata(md, where: Path, sizes: dict[str, int], world: int) -> None:
    """The unpickled metadata has exactly the shape of what schedc saves: tensor items only
    (a bytes item would reach torch.load(weights_only=False)), keys executor_state writes,
    every stored chunk inside one of the checkpoint's hashed .distcp files, no transforms;
    and nothing that costs more to load than what it declares: at most one chunk per rank
    of an item, tiling it, each stored in a record the size of its tensor (torch.save
    never compresses; a deflated record of 2 MB once loaded into 2.4 GB)."""

    def bad(what: str):
        raise CheckpointError(f"{where}: refused: {what}")

    def shape(v, n: int | None = None) -> bool:
        return (
            type(v) is torch.Size
            and (n is None or len(v) == n)
            and all(type(x) is int and 0 <= x < 2**48 for x in v)
        )

    if type(md) is not Metadata:
        bad(f"a {type(md).__name__}, not DCP Metadata")
    items = md.state_dict_metadata
    if type(items) is not dict or not items:
        bad("no state_dict_metadata")
    for k, v in items.items():
        if type(k) is not str or not _ITEM.fullmatch(k):
            bad(f"declares item {str(k)[:60]!r}, which schedc never writes")
        if type(v) is not TensorStorageMetadata:
            bad(f"item {k} is a {type(v).__name__}, not a tensor; schedc writes tensors only")
        p = v.properties
        if (
            type(p) is not TensorProperties
            or p.dtype not in _DTYPES
            or (p.layout is not torch.strided)
        ):
            bad(f"item {k} has tensor properties schedc never writes")
        if (
            not shape(v.size)
            or type(v.chunks) is not list
            or not all(
                type(c) is ChunkStorageMetadata
                and shape(c.offsets, len(v.size))
                and shape(c.sizes, len(v.size))
                for c in v.chunks
            )
        ):
            bad(f"item {k} has a malformed shape or chunk list")
        if not 0 < len(v.chunks) <= world:
            bad(
                f"item {k} has {len(v.chunks)} chunks; a checkpoint of {world} "
                f"rank{'s' * (world != 1)} has 1 to {world}"
            )
        if any(o + n > d for c in v.chunks for o, n, d in zip(c.offsets, c.sizes, v.size)) or sum(
            math.prod(c.sizes) for c in v.chunks
        ) != math.prod(v.size):
            bad(f"item {k}: its chunks do not tile its {tuple(v.size)} elements")
    if md.planner_data is not None and (
        type(md.planner_data) is not dict
        or not all(
            type(v) is tuple and all(type(x) is str for x in v) for v in md.planner_data.values()
        )
    ):
        bad("malformed planner_data")
    if md.version is not None and type(md.version) is not str:
        bad("malformed version")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        bad("malformed storage_meta")
    if type(md.storage_data) is not dict:
        bad("no storage_data")
    for idx, info in md.storage_data.items():
        if type(idx) is not MetadataIndex or idx.fqn not in items:
            bad(f"storage for an undeclared item {str(getattr(idx, 'fqn', idx))[:60]!r}")
        if type(info) is not _StorageInfo:
            bad(f"storage of {idx.fqn} is a {type(info).__name__}")
        f = info.relative_path
        if type(f) is not str or f == ".metadata" or f not in sizes:
            bad(
                f"item {idx.fqn} is stored in {str(f)[:60]!r}, which is not one of this "
                "checkpoint's hashed files (meta.json 'files')"
            )
        if (
            type(info.offset) is not int
            or type(info.length) is not int
            or not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= sizes[f])
        ):
            bad(f"item {idx.fqn}: bytes {info.offset}+{info.length} lie outside {f}")
        if info.transform_descriptors:
            bad(f"item {idx.fqn} asks for stream transforms, which schedc never writes")
        v = items[idx.fqn]
        chunk = next((c for c in v.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
        if chunk is None:
            bad(f"storage of {idx.fqn} at {idx.offset} is no chunk of it")
        n = math.prod(chunk.sizes) * v.properties.dtype.itemsize
        if not n <= info.length <= n + RECORD_SLACK:
            bad(
                f"item {idx.fqn}: a record of {info.length} bytes for a chunk of {n} "
                f"(schedc writes {n} plus at most {RECORD_SLACK} of headers)"
            )
    if len(md.storage_data) != sum(len(v.chunks) for v in items.values()):
        bad("the storage entries are not one a chunk")


def _check_records(md, step: Path) -> None:
    """Every stored chunk's record is what torch.save writes: a zip archive of stored
    (uncompressed) entries no larger than the chunk plus headers. Read from the records'
    central directories only, before torch.load inflates anything (a 2 MB deflated record
    once became 2.4 GB)."""
    items = md.state_dict_metadata
    by_file: dict[str, list] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((idx, info))
    for fname, entries in by_file.items():
        where = step / fname
        fd = _open(where)
        with os.fdopen(fd, "rb") as f:
            for idx, info in entries:
                v = items[idx.fqn]
                chunk = next(c for c in v.chunks if tuple(c.offsets) == tuple(idx.offset or ()))
                n = math.prod(chunk.sizes) * v.properties.dtype.itemsize
                try:
                    with zipfile.ZipFile(_Window(f, info.offset, info.length)) as z:
                        infos = z.infolist()
                except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
                    raise CheckpointError(
                        f"{where}: the record of {idx.fqn} is not a tensor torch.save wrote: {e}"
                    ) from None
                packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
                size = sum(i.file_size for i in infos)
                if packed or size > n + RECORD_SLACK or len(infos) > 64:
                    raise CheckpointError(
                        f"{where}: the record of {idx.fqn} holds {size} bytes"
                        + (" compressed" if packed else "")
                        + f" for a chunk of {n}; torch.save stores a tensor's bytes as they are"
                    )


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.at = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.length}[whence]
        self.at = min(max(base + pos, 0), self.length)
        return self.at

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.at)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.at)
        data = self.f.read(n)
        buf[: len(data)] = data
        self.at += len(data)
        return len(data)


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that admits exactly the globals DCP's metadata of a schedc checkpoint
    pickles (recorded from DDP, FSDP and single-process saves at worlds 1 and 2), by
    (module, name), never by prefix or dotted path; calls (REDUCE) only the four factories
    among them; builds (NEWOBJ, BUILD) only instances of the seven metadata dataclasses with
    their own fields; and refuses every other opcode that creates or calls. It is Python's
    own pure-Python unpickler with those dispatch entries replaced."""

    ALLOWED = frozenset(
        {
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        }
        | {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            *(
                ("torch", str(d).removeprefix("torch."))
                for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            ),
        }
    )
    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: RUF012 - pickle reads it off the class
    # Resource bounds. schedc's metadata nests 7 deep (Metadata, dict, item, list, chunk,
    # Size, int) and holds a few objects per tensor (GPT-2 FSDP at world 8: under 10,000);
    # a tuple nested 10^6 deep in 1 MB crashed the interpreter when freed or compared.
    MAX_DEPTH = 32
    MAX_OBJECTS = 200_000

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._depth: dict[int, int] = {}
        self._alive: list = []  # every container made, so no id() is reused while loading

    def _nest(self, obj, children) -> None:
        """`obj` holds `children`: it nests one deeper than the deepest of them."""
        key = id(obj)
        if key not in self._depth:
            self._depth[key] = 0
            self._alive.append(obj)
            if len(self._alive) > self.MAX_OBJECTS:
                raise pickle.UnpicklingError(f"metadata holds over {self.MAX_OBJECTS} objects")
        d = 1 + max((self._depth.get(id(c), 0) for c in children), default=0)
        if d > self._depth[key]:
            if d > self.MAX_DEPTH:
                raise pickle.UnpicklingError(f"metadata nests deeper than {self.MAX_DEPTH} levels")
            self._depth[key] = d

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"metadata names {module}.{name}, which a DCP checkpoint never does"
            )
        return getattr(importlib.import_module(module), name)  # name has no dot: exact

    def _refuse(self, what: str):
        raise pickle.UnpicklingError(
            f"metadata uses pickle's {what}, which a DCP checkpoint never does"
        )

    def _reduce(self):
        if not any(self.stack[-2] is f for f in _factories()):
            self._refuse(f"REDUCE on {_name(self.stack[-2])}")
        pickle._Unpickler.load_reduce(self)

    def _newobj(self):
        if not any(self.stack[-2] is c for c in _classes()):
            self._refuse(f"NEWOBJ of {_name(self.stack[-2])}")
        pickle._Unpickler.load_newobj(self)

    def _build(self):
        inst, state = self.stack[-2], self.stack[-1]
        cls = type(inst)
        if not any(cls is c for c in _classes()):
            self._refuse(f"BUILD on {_name(inst)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        ok = (
            type(state) is tuple and len(state) == 5
            if cls is TensorProperties
            else type(state) is dict and all(type(k) is str and k in fields for k in state)
        )
        if not ok:
            self._refuse(f"BUILD of {cls.__name__} with a state it never has")
        pickle._Unpickler.load_build(self)

    def _made(load):
        """A container from the stack (TUPLE, LIST, DICT, ...): nested one below its items."""

        def made(self):
            load(self)
            top = self.stack[-1]
            items = [*top.keys(), *top.values()] if type(top) is dict else top
            self._nest(top, items)

        return made

    def _filled(load, where):
        """Items added to a container already made (APPEND, SETITEMS, ...)."""

        def filled(self):
            target, items = where(self)
            items = list(items)
            load(self)
            self._nest(self.stack[-1] if target is None else target, items)

        return filled

    for op, fn in ((pickle.REDUCE, _reduce), (pickle.NEWOBJ, _newobj), (pickle.BUILD, _build)):
        dispatch[op[0]] = fn
    for name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET"):
        op = getattr(pickle, name)
        dispatch[op[0]] = _made(dispatch[op[0]])
    for name, where in (
        ("APPEND", lambda self: (self.stack[-2], self.stack[-1:])),
        ("SETITEM", lambda self: (self.stack[-3], self.stack[-2:])),
        ("APPENDS", lambda self: (self.metastack[-1][-1], self.stack)),
        ("SETITEMS", lambda self: (self.metastack[-1][-1], self.stack)),
        ("ADDITEMS", lambda self: (self.metastack[-1][-1], self.stack)),
        ("REDUCE", lambda self: (None, self.stack[-1:])),
        ("NEWOBJ", lambda self: (None, self.stack[-1:])),
        ("BUILD", lambda self: (self.stack[-2], self.stack[-1:])),
    ):
        op = getattr(pickle, name)
        dispatch[op[0]] = _filled(dispatch[op[0]], where)
    for name in ("INST", "OBJ", "NEWOBJ_EX", "PERSID", "BINPERSID"):
        dispatch[getattr(pickle, name)[0]] = lambda self, name=name: self._refuse(name)
    del op, fn, name, where


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or f"a {type(obj).__name__}"


def _classes() -> tuple:
    return (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
        ChunkStorageMetadata,
        _StorageInfo,
    )


def _factories() -> tuple:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.serialization import _get_layout

    return (torch.Size, _MEM_FORMAT_ENCODING, _get_layout, PosixPath)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
