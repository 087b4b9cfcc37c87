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
import hashlib
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch

from schedc.cli.main import main
from schedc.exec import hf
from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.dcp_metadata import SafeReader, check_metadata, check_records
from schedc.exec.checkpoint.layout import CheckpointError
from schedc.exec.checkpoint.meta_json import verify
from schedc.model.arch import SIZES
from schedc.model.hf import HFError, export_config, weights_file
from tests.exec.test_checkpoint_tamper import STEP, meta_of, rehash, saved  # noqa: F401
from tests.goldens import REPO
from tests.ranks import python

TINY = REPO / "schedules" / "tiny_1gpu.sched"
GIB32 = 32 << 30


def copy_of(saved, tmp_path: Path) -> Path:  # noqa: F811 - the fixture's value
    ck = tmp_path / "ck"
    shutil.copytree(saved.base / "plain", ck)
    return ck


def one_line(err: str) -> str:
    (line,) = err.strip().splitlines()
    return line


# -- --init hf: a sparse 32 GiB weights file ----------------------------------------------------


@pytest.fixture
def sparse_dir(tmp_path) -> Path:
    """config.json of the tiny model beside a 32 GiB model.safetensors of holes (no disk)."""
    d = tmp_path / "sparse"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(export_config(SIZES["tiny"], "float32")))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(GIB32)
    return d


def test_a_sparse_32_gib_weights_file_is_refused_by_its_size(sparse_dir):
    """The check that runs before anything hashes or reads the file: stat alone."""
    with pytest.raises(HFError, match=rf"model.safetensors: {GIB32} bytes, more than"):
        weights_file(sparse_dir, SIZES["tiny"])


def test_schedc_run_refuses_the_sparse_file_before_the_ranks_start(sparse_dir):
    """As a user meets it: refused while the flags are checked (`schedc: error:`, not a
    rank's error after every rank hashed 32 GiB, which took 90 s here)."""
    r = python(
        "-m", "schedc", "run", str(TINY), "--steps", "1", "--init", f"hf:{sparse_dir}", timeout=600
    )
    assert r.returncode == 1, r.stderr
    line = one_line(r.stderr)
    assert line.startswith(f"schedc: error: {sparse_dir / 'model.safetensors'}: {GIB32} bytes")


# -- --init hf: Hugging Face's hub cache, whose files are links ---------------------------------


@pytest.fixture
def hub_cache(saved, tmp_path) -> Path:  # noqa: F811
    """The saved checkpoint exported, laid out as huggingface_hub's cache lays out a download:
    models--NAME/snapshots/REV/{config.json,model.safetensors} -> ../../blobs/SHA256."""
    out = tmp_path / "export"
    hf.export(str(saved.base / "plain"), out)
    repo = tmp_path / "hub" / "models--schedc--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        sha = hashlib.sha256((out / name).read_bytes()).hexdigest()
        shutil.move(out / name, repo / "blobs" / sha)
        (snap / name).symlink_to(Path("..", "..", "blobs", sha))
    return snap


def test_init_reads_weights_through_the_hub_caches_links(saved, hub_cache):  # noqa: F811
    model = SIZES["tiny"]
    assert weights_file(hub_cache, model) == hub_cache / "model.safetensors"
    assert hf.source(hub_cache).startswith(f"hf:{hub_cache.resolve()} (sha256 ")
    got = hf.load(hub_cache, model, "tiny")
    assert got.keys() == saved.params.keys()
    assert all(torch.equal(got[k], saved.params[k]) for k in got)


def test_schedc_run_starts_from_the_hub_cache(hub_cache):
    r = python("-m", "schedc", "run", str(TINY), "--steps", "1", "--init", f"hf:{hub_cache}")
    assert r.returncode == 0, r.stderr
    assert f"schedc: weights of step 0 from hf:{hub_cache}" in r.stdout, r.stdout


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "directory", "missing"])
def test_a_link_to_anything_but_a_regular_file_is_still_refused(hub_cache, tmp_path, target):
    """Following links keeps what refusing them guarded: no FIFO (a read that waits for a
    writer forever), no device (/dev/zero never ends), each one line naming the file."""
    weights = hub_cache / "model.safetensors"
    weights.unlink()
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
    elif target == "directory":
        (tmp_path / "directory").mkdir()
    weights.symlink_to(target if target.startswith("/") else tmp_path / target)
    for check in (
        lambda: weights_file(hub_cache, SIZES["tiny"]),
        lambda: hf.source(hub_cache),
        lambda: hf.load(hub_cache, SIZES["tiny"], "tiny"),
    ):
        with pytest.raises(HFError) as e:
            check()
        assert str(e.value).startswith(f"{weights}: "), e.value
        assert "\n" not in str(e.value)


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


# -- schedc export: where it writes, what it leaves, the modes ----------------------------------


@pytest.mark.parametrize("where", [".", STEP, f"{STEP}/hf", "hf/inner"])
def test_export_into_the_checkpoint_is_refused(saved, tmp_path, capsys, where):  # noqa: F811
    ck = copy_of(saved, tmp_path)
    before = sorted(p.relative_to(ck) for p in ck.rglob("*"))
    out = ck / where
    assert main(["export", str(ck), "-o", str(out)]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"schedc: error: -o {out}: inside the checkpoint {ck}"), line
    assert sorted(p.relative_to(ck) for p in ck.rglob("*")) == before


def test_export_of_one_step_into_its_save_directory_is_refused(saved, tmp_path, capsys):  # noqa: F811
    ck = copy_of(saved, tmp_path)
    assert main(["export", str(ck / STEP), "-o", str(ck / STEP / "hf")]) == 1
    assert "inside the checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("blocked", ["model.safetensors", "config.json"])
def test_a_failed_export_leaves_no_temporary_file(saved, tmp_path, capsys, blocked):  # noqa: F811
    """A directory where a file is to go: the rename fails after the bytes are written."""
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    assert main(["export", str(saved.base / "plain"), "-o", str(out)]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"schedc: error: -o {out}: cannot write {blocked}: "), line
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {blocked} | ({"model.safetensors"} if blocked == "config.json" else set())
    )


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_exported_files_get_the_mode_the_umask_gives(saved, tmp_path, umask, mode):  # noqa: F811
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        assert main(["export", str(saved.base / "plain"), "-o", str(out)]) == 0
    finally:
        os.umask(old)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == mode, name


# -- resuming a finished run --------------------------------------------------------------------


def test_resuming_a_finished_run_claims_no_measurement(saved, tmp_path):  # noqa: F811
    ck = copy_of(saved, tmp_path)
    assert meta_of(ck / STEP)["step"] == 1
    r = python("-m", "schedc", "run", str(TINY), "--steps", "1", "--resume", str(ck))
    assert r.returncode == 0, r.stderr
    assert "nothing to run (resumed at step 1 of 1)" in r.stdout, r.stdout
    assert "0 B measured" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("schedc: memory per rank:")]
    assert line.endswith("no step ran, so nothing was measured"), line
    assert " measured" not in line.removesuffix("nothing was measured"), line
