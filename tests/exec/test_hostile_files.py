"""What a new user and an adversary still hit (issue #42): files schedc reads or writes
around `--init hf:`, `schedc export` and `--resume`.

    weights      a sparse 32 GiB model.safetensors is refused by its size (stat) before a
                 byte is hashed; Hugging Face's hub cache (snapshots/REV/FILE -> ../../blobs/SHA)
                 is read through its links, a link to a FIFO or a device still is not
    .metadata    a DCP metadata whose fields have the wrong types (a MetadataIndex offset
                 that is an int, hash updated) is one CheckpointError naming the file, in
                 export (exit 1, never 2) and resume
    export       -o inside the checkpoint is refused; a failed export leaves no temporary
                 file; the files it writes get the mode the umask gives
    resume       of a finished run: no memory line claiming "0 B measured"

The checkpoint is test_checkpoint_tamper.py's `saved` (tiny_1gpu.sched, one step, saved in
this process): its step is the last one, so resuming it runs nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from schedc.cli.main import main
from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.dcp_metadata import SafeReader, check_metadata, check_records
from schedc.exec.checkpoint.layout import CheckpointError
from schedc.exec.checkpoint.meta_json import verify
from tests.exec.test_checkpoint_tamper import STEP, meta_of, rehash, saved  # noqa: F401
from tests.goldens import REPO

TINY = REPO / "schedules" / "tiny_1gpu.sched"
GIB32 = 32 << 30


def copy_of(saved, tmp_path: Path) -> Path:  # noqa: F811 - the fixture's value
    ck = tmp_path / "ck"
    shutil.copytree(saved.base / "plain", ck)
    return ck


def one_line(err: str) -> str:
    (line,) = err.strip().splitlines()
    return line


# -- a DCP .metadata of the allowed classes, with fields of the wrong types ---------------------


def write_metadata(step: Path, md) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(md))
    rehash(step)


def int_offset(step: Path) -> None:
    """The issue's finding: a MetadataIndex whose offset is an int, hash updated."""
    md = pickle.loads((step / ".metadata").read_bytes())  # our own, freshly saved: trusted
    idx, info = next(iter(md.storage_data.items()))
    del md.storage_data[idx]
    bad = copy.copy(idx)
    object.__setattr__(bad, "offset", 7)  # MetadataIndex's __init__ would make it a Size
    md.storage_data[bad] = info
    write_metadata(step, md)


def test_export_of_a_metadata_with_an_int_offset_is_exit_1_naming_it(saved, tmp_path, capsys):  # noqa: F811
    ck = copy_of(saved, tmp_path)
    int_offset(ck / STEP)
    assert main(["export", str(ck), "-o", str(tmp_path / "out")]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"schedc: error: {ck / STEP / '.metadata'}: refused: "), line


def test_resume_from_a_metadata_with_an_int_offset_names_it(saved, tmp_path):  # noqa: F811
    ck = copy_of(saved, tmp_path)
    int_offset(ck / STEP)
    with pytest.raises(CheckpointError) as e:
        store.load(saved.ex, ck)
    assert str(e.value).startswith(f"{ck / STEP / '.metadata'}: refused: "), e.value


DELETED = object()  # the field not set at all: NEWOBJ without BUILD
WRONG = (7, -1, 2.5, "x", None, b"x", [1], (1,), {"a": 1}, torch.Size([1, 2]), torch.float32)
NONE = type(None)
# the types each field may hold; a value of any other type must be refused
TYPES = {
    "Metadata": {
        "state_dict_metadata": dict,
        "planner_data": (NONE, dict),
        "storage_data": dict,
        "storage_meta": (NONE, "StorageMeta"),
        "version": (NONE, str),
    },
    "TensorStorageMetadata": {"properties": "TensorProperties", "size": torch.Size, "chunks": list},
    "TensorProperties": {
        "dtype": torch.dtype,
        "layout": torch.layout,
        "requires_grad": bool,
        "memory_format": torch.memory_format,
        "pin_memory": bool,
    },
    "ChunkStorageMetadata": {"offsets": torch.Size, "sizes": torch.Size},
    "MetadataIndex": {"fqn": str, "offset": torch.Size, "index": (NONE, int)},
    "_StorageInfo": {
        "relative_path": str,
        "offset": int,
        "length": int,
        "transform_descriptors": (NONE, list, tuple),
    },
    "StorageMeta": {
        "checkpoint_id": (NONE, str, Path),
        "save_id": (NONE, str),
        "load_id": (NONE, str),
        "modules": list,
    },
}


def parts(md) -> dict[str, object]:
    """One object of each kind the metadata holds: the first item's, the first entry's."""
    item = next(iter(md.state_dict_metadata.values()))
    idx, info = next(iter(md.storage_data.items()))
    objs = [md, item, item.properties, item.chunks[0], idx, info, md.storage_meta]
    return {type(o).__name__: o for o in objs}


def with_field(md, kind: str, name: str, value):
    """A copy of the metadata with one field of its first object of `kind` set to `value`
    (or deleted); None where no pickle can hold it (a key that cannot be hashed)."""
    md = copy.deepcopy(md)
    obj = parts(md)[kind]
    if kind == "MetadataIndex":  # a dict key: put back under its new hash
        info = md.storage_data.pop(obj)
        obj = copy.copy(obj)
    if value is DELETED:
        object.__delattr__(obj, name) if name in vars(obj) else None
    else:
        object.__setattr__(obj, name, value)
    if kind == "MetadataIndex":
        try:
            md.storage_data[obj] = info
        except (TypeError, AttributeError):  # unpickling it fails before any check
            return None
    return md


def allowed(cls: type, name: str, value) -> bool:
    """A value of a type the field holds, or the field not set where its class has a
    default (what DCP reads then)."""
    if value is DELETED:
        return hasattr(cls, name)
    types = TYPES[cls.__name__][name]
    types = types if type(types) is tuple else (types,)
    return any(type(value).__name__ == t if type(t) is str else type(value) is t for t in types)


def test_every_field_of_a_wrong_type_is_refused_naming_the_file(saved):  # noqa: F811
    """Each field of each kind of object in the metadata, set to values of other types or
    not set: the checks that run before DCP reads (check_metadata, check_records) refuse it
    naming the file, never fail with another exception (which `schedc` says as an internal
    error, exit 2), and never pass a value of a type the field never holds."""
    step = saved.base / "plain" / STEP
    meta = verify(step)
    md = pickle.loads((step / ".metadata").read_bytes())  # our own: trusted here
    assert set(parts(md)) == set(TYPES)
    where = step / ".metadata"
    wrong = []
    for kind, fields in TYPES.items():
        assert set(fields) == {f.name for f in dataclasses.fields(parts(md)[kind])}, kind
        for name in fields:
            for value in (*WRONG, DELETED):
                bad = with_field(md, kind, name, value)
                if bad is None:
                    continue
                said = f"{kind}.{name} = {'(not set)' if value is DELETED else repr(value)}"
                try:
                    check_metadata(bad, where, meta["_sizes"], meta["world"])
                    check_records(bad, step)
                except CheckpointError as e:
                    if not str(e).startswith(f"{where}: refused: "):
                        wrong.append(f"{said}: refused without naming {where}: {e}")
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    wrong.append(f"{said}: {type(e).__name__}: {e}")
                else:
                    if not allowed(type(parts(md)[kind]), name, value):
                        wrong.append(f"{said}: passed")
    assert not wrong, "\n".join(wrong)


def test_the_reader_refuses_what_the_checks_refuse_from_the_file(saved, tmp_path):  # noqa: F811
    """The same int offset through the unpickler, as DCP's reader meets it."""
    ck = copy_of(saved, tmp_path)
    int_offset(ck / STEP)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused: .*offset"):
        SafeReader(ck / STEP).read_metadata()
