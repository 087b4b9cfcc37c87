"""DCP's `.metadata`, checked before DCP reads a tensor: its bytes hashed as meta.json says,
unpickled with an exact allowlist (unpickler.py), its structure what schedc writes.

Tensor data is read by DCP itself; in torch 2.13 FileSystemReader.read_data reads a tensor
item with torch.load(..., weights_only=True), and only a bytes item (BytesStorageMetadata)
goes to DefaultLoadPlanner.load_bytes, which calls torch.load(weights_only=False): schedc
never writes bytes items (the RNG state lives in meta.json), so a metadata that declares one
is refused before DCP reads anything. Nothing costs more to load than it declares: at most
one chunk per rank of an item, tiling it, each stored in a record the size of its tensor
(torch.save never compresses; a deflated record of 2 MB once loaded into 2.4 GB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path, PosixPath
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from schedc.exec.checkpoint.files import open_regular, read_bounded
from schedc.exec.checkpoint.layout import (
    DTYPES,
    ITEM,
    MAX_METADATA_BYTES,
    RECORD_SLACK,
    CheckpointError,
)
from schedc.exec.checkpoint.meta_json import verify
from schedc.exec.checkpoint.unpickler import MetadataUnpickler


class SafeReader(FileSystemReader):
    """DCP's file reader, reading only a checked .metadata: its bytes hashed as meta.json says,
    unpickled with an exact allowlist, its structure what schedc writes (check_metadata)."""

    def __init__(self, path: str | os.PathLike, meta: dict | None = None):
        super().__init__(path)
        self.meta = meta if meta is not None else verify(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"  # never __R.metadata: schedc does not write those
        data = read_bounded(path, MAX_METADATA_BYTES, "DCP metadata")
        if hashlib.sha256(data).hexdigest() != self.meta["files"][".metadata"]:
            raise CheckpointError(
                f"{path}: contents do not match the checkpoint's hash (changed while loading)"
            )
        try:
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed pickle: every kind of error
            raise CheckpointError(
                f"{path}: refused: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}"
            ) from None
        check_metadata(metadata, path, self.meta["_sizes"], self.meta["world"])
        check_records(metadata, Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_metadata(md: Any, where: Path, sizes: dict[str, int], world: int) -> None:
    """The unpickled metadata has exactly the shape of what schedc saves: tensor items only
    (a bytes item would reach torch.load(weights_only=False)), keys executor_state writes,
    every stored chunk inside one of the checkpoint's hashed .distcp files, no transforms;
    and nothing that costs more to load than what it declares: at most one chunk per rank
    of an item, tiling it, each stored in a record the size of its tensor."""
    problem = _problem(md, sizes, world)
    if problem is not None:
        raise CheckpointError(f"{where}: refused: {problem}")


def _problem(md: Any, sizes: dict[str, int], world: int) -> str | None:
    """The first thing wrong with the metadata, in the order below, or None. Every field is
    checked for its type before it is used: the unpickler admits the classes, not what
    their fields hold (an int where an offset's Size belongs), nor that BUILD set them."""
    if not _is(md, Metadata):
        return f"a {type(md).__name__}, not DCP Metadata"
    items = md.state_dict_metadata
    if type(items) is not dict or not items:
        return "no state_dict_metadata"
    return (
        _first(check(k, v, world) for k, v in items.items() for check in _ITEM_CHECKS)
        or _header(md)
        or _first(
            check(idx, info, items, sizes)
            for idx, info in md.storage_data.items()
            for check in _STORAGE_CHECKS
        )
        or _one_entry_a_chunk(md.storage_data, items)
    )


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def _is(obj: Any, cls: type) -> bool:
    """`obj` is exactly a `cls` with every field set (NEWOBJ without BUILD sets none)."""
    return type(obj) is cls and all(hasattr(obj, f.name) for f in dataclasses.fields(cls))


# -- each declared item: a tensor schedc writes, cut into chunks that tile it -------------------


def _shape(v: Any, n: int | None = None) -> bool:
    return (
        type(v) is torch.Size
        and (n is None or len(v) == n)
        and all(type(x) is int and 0 <= x < 2**48 for x in v)
    )


def _item_name(k: Any, v: Any, world: int) -> str | None:
    if type(k) is not str or not ITEM.fullmatch(k):
        return f"declares item {str(k)[:60]!r}, which schedc never writes"
    return None


def _item_tensor(k: str, v: Any, world: int) -> str | None:
    if not _is(v, TensorStorageMetadata):
        return f"item {k} is a {type(v).__name__}, not a tensor; schedc writes tensors only"
    return None


def _item_properties(k: str, v: TensorStorageMetadata, world: int) -> str | None:
    p = v.properties
    if not (
        _is(p, TensorProperties)
        and type(p.dtype) is torch.dtype
        and p.dtype in DTYPES
        and p.layout is torch.strided
        and p.memory_format is torch.contiguous_format
        and type(p.requires_grad) is bool
        and type(p.pin_memory) is bool
    ):
        return f"item {k} has tensor properties schedc never writes"
    return None


def _item_shape(k: str, v: TensorStorageMetadata, world: int) -> str | None:
    def chunk(c: Any) -> bool:
        return (
            _is(c, ChunkStorageMetadata)
            and _shape(c.offsets, len(v.size))
            and _shape(c.sizes, len(v.size))
        )

    if not _shape(v.size) or type(v.chunks) is not list or not all(map(chunk, v.chunks)):
        return f"item {k} has a malformed shape or chunk list"
    return None


def _item_chunk_count(k: str, v: TensorStorageMetadata, world: int) -> str | None:
    if not 0 < len(v.chunks) <= world:
        return (
            f"item {k} has {len(v.chunks)} chunks; a checkpoint of {world} "
            f"rank{'s' * (world != 1)} has 1 to {world}"
        )
    return None


def _item_tiled(k: str, v: TensorStorageMetadata, world: int) -> str | None:
    inside = all(o + n <= d for c in v.chunks for o, n, d in zip(c.offsets, c.sizes, v.size))
    if not inside or sum(math.prod(c.sizes) for c in v.chunks) != math.prod(v.size):
        return f"item {k}: its chunks do not tile its {tuple(v.size)} elements"
    return None


# each check runs only once every check before it passed for that item
_ITEM_CHECKS: tuple[Callable[[Any, Any, int], str | None], ...] = (
    _item_name,
    _item_tensor,
    _item_properties,
    _item_shape,
    _item_chunk_count,
    _item_tiled,
)


# -- the metadata's other fields ----------------------------------------------------------------


def _header(md: Metadata) -> str | None:
    if not _planner_data(md.planner_data):
        return "malformed planner_data"
    if md.version is not None and type(md.version) is not str:
        return "malformed version"
    if md.storage_meta is not None and not _storage_meta(md.storage_meta):
        return "malformed storage_meta"
    if type(md.storage_data) is not dict:
        return "no storage_data"
    return None


def _storage_meta(sm: Any) -> bool:
    """What DCP's save records of itself: ids (strings; the checkpoint's a path) and the
    modules it saved (a list of strings)."""
    return (
        _is(sm, StorageMeta)
        and (sm.checkpoint_id is None or type(sm.checkpoint_id) in (str, PosixPath))
        and all(x is None or type(x) is str for x in (sm.save_id, sm.load_id))
        and type(sm.modules) is list
        and all(type(m) is str for m in sm.modules)
    )


def _planner_data(pd: Any) -> bool:
    """None, or the planner's names: a dict of tuples of strings."""
    return pd is None or (
        type(pd) is dict
        and all(type(v) is tuple and all(type(x) is str for x in v) for v in pd.values())
    )


# -- each storage entry: a declared chunk, in a hashed file, in a record of its size ------------


def _stored_item(idx: Any, info: Any, items: dict, sizes: dict[str, int]) -> str | None:
    if not _is(idx, MetadataIndex) or type(idx.fqn) is not str or idx.fqn not in items:
        return f"storage for an undeclared item {str(getattr(idx, 'fqn', idx))[:60]!r}"
    return None


def _stored_index(idx: MetadataIndex, info: Any, items: dict, sizes: dict[str, int]) -> str | None:
    """The entry's key: the offset of a chunk of its item (a Size of the item's dimensions;
    None only for a tensor of none), and an index hint that is a number or None."""
    at, dims = idx.offset, len(items[idx.fqn].size)
    if not ((at is None and dims == 0) or _shape(at, dims)) or not (
        idx.index is None or type(idx.index) is int
    ):
        return (
            f"storage of {idx.fqn} has offset {str(at)[:60]} and index "
            f"{str(idx.index)[:20]}; a chunk of its {dims} dimensions has a Size"
        )
    return None


def _stored_info(idx: MetadataIndex, info: Any, items: dict, sizes: dict[str, int]) -> str | None:
    if not _is(info, _StorageInfo):
        return f"storage of {idx.fqn} is a {type(info).__name__}"
    return None


def _stored_file(
    idx: MetadataIndex, info: _StorageInfo, items: dict, sizes: dict[str, int]
) -> str | None:
    f: Any = info.relative_path
    if type(f) is not str or f == ".metadata" or f not in sizes:
        return (
            f"item {idx.fqn} is stored in {str(f)[:60]!r}, which is not one of this "
            "checkpoint's hashed files (meta.json 'files')"
        )
    return None


def _stored_bounds(
    idx: MetadataIndex, info: _StorageInfo, items: dict, sizes: dict[str, int]
) -> str | None:
    at, n, f = info.offset, info.length, info.relative_path
    if type(at) is not int or type(n) is not int or not (0 <= at and 0 <= n and at + n <= sizes[f]):
        return f"item {idx.fqn}: bytes {at}+{n} lie outside {f}"
    return None


def _stored_plain(
    idx: MetadataIndex, info: _StorageInfo, items: dict, sizes: dict[str, int]
) -> str | None:
    td = info.transform_descriptors
    if not (td is None or (type(td) in (list, tuple) and not td)):
        return f"item {idx.fqn} asks for stream transforms, which schedc never writes"
    return None


def _stored_chunk(
    idx: MetadataIndex, info: _StorageInfo, items: dict, sizes: dict[str, int]
) -> str | None:
    n = chunk_bytes(items[idx.fqn], idx)
    if n is None:
        return f"storage of {idx.fqn} at {idx.offset} is no chunk of it"
    if not n <= info.length <= n + RECORD_SLACK:
        return (
            f"item {idx.fqn}: a record of {info.length} bytes for a chunk of {n} "
            f"(schedc writes {n} plus at most {RECORD_SLACK} of headers)"
        )
    return None


# each check runs only once every check before it passed for that entry
_STORAGE_CHECKS: tuple[Callable[[Any, Any, dict, dict[str, int]], str | None], ...] = (
    _stored_item,
    _stored_index,
    _stored_info,
    _stored_file,
    _stored_bounds,
    _stored_plain,
    _stored_chunk,
)


def _one_entry_a_chunk(storage: dict, items: dict[str, Any]) -> str | None:
    if len(storage) != sum(len(v.chunks) for v in items.values()):
        return "the storage entries are not one a chunk"
    return None


def chunk_bytes(v: TensorStorageMetadata, idx: MetadataIndex) -> int | None:
    """The bytes of the chunk of item `v` that storage entry `idx` holds (None: no chunk)."""
    chunk = next((c for c in v.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
    if chunk is None:
        return None
    return math.prod(chunk.sizes) * v.properties.dtype.itemsize


# -- the records: what torch.save writes --------------------------------------------------------


def check_records(md: Metadata, step: Path) -> None:
    """Every stored chunk's record is what torch.save writes: a zip archive of stored
    (uncompressed) entries no larger than the chunk plus headers. Read from the records'
    central directories only, before torch.load inflates anything (a 2 MB deflated record
    once became 2.4 GB)."""
    by_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((idx, info))
    for fname, entries in by_file.items():
        where = step / fname
        with os.fdopen(open_regular(where), "rb") as f:
            for idx, info in entries:
                _check_record(f, where, idx, info, md.state_dict_metadata[idx.fqn])


def _check_record(
    f: IO[bytes], where: Path, idx: MetadataIndex, info: _StorageInfo, v: Any
) -> None:
    n = chunk_bytes(v, idx)
    assert n is not None, "check_metadata found the chunk of every storage entry"
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

    def __init__(self, f: IO[bytes], offset: int, length: int):
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

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.length - self.at)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.at)
        data = self.f.read(n)
        buf[: len(data)] = data
        self.at += len(data)
        return len(data)
