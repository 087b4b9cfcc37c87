"""The checkpoint tamper suite (issue 14): crafted checkpoints that try to run code, escape
the directory, hang the loader, or pass off altered tensors as schedc's.

Every attack starts from a real checkpoint, saved once per module by a real executor (the
tiny single-process schedule, one step), copies it, alters the copy as an attacker who can
write the directory would (rewriting meta.json's hashes to match, where that helps the
attack), and loads it with schedc.exec.checkpoint.store.load. Each must end in a one-line
CheckpointError that names the offending file, and no gadget may create its canary file.
Each gadget is first shown to be live: plain pickle.loads runs it (test_each_gadget_is_live).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from schedc.exec.checkpoint import files, store
from schedc.exec.checkpoint.layout import HMAC_FILE, MAX_META_BYTES, RECORD_SLACK, CheckpointError
from tests.goldens import REPO
from tests.ranks import python

KEY, OTHER_KEY = bytes(range(32)), b"another key, also 32 bytes long!"
STEP = "step_00000001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One executor (tiny_1gpu, one step) and its checkpoint, saved plain and with KEY."""
    from schedc.compiler import compile_file
    from schedc.exec.executor import Executor
    from schedc.exec.options import Comm, RunOptions
    from schedc.lang.resolve import Overrides

    base = tmp_path_factory.mktemp("saved")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    compiled = compile_file(REPO / "schedules" / "tiny_1gpu.sched", Overrides(steps=1))
    ex = Executor(compiled, Comm(0, 1), RunOptions(device="cpu", log=False))
    ex.step()
    store.save(ex, base / "plain")
    store.save(ex, base / "keyed", key=KEY)
    params = {k: v.detach().clone() for k, v in ex.params.items()}
    yield SimpleNamespace(ex=ex, base=base, params=params)
    ex.close()
    dist.destroy_process_group()


# -- an attacker's tools ------------------------------------------------------------------------


def sbu(s: str) -> bytes:  # SHORT_BINUNICODE
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def glob0(module: str, name: str, arg: str) -> bytes:
    """Protocol 0: GLOBAL module.name, called (REDUCE) with one string."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode()


def glob4(module: str, name: str, arg: bytes) -> bytes:
    """Protocol 4: STACK_GLOBAL module/name (a dotted name walks attributes), REDUCE(arg)."""
    return b"\x80\x04" + sbu(module) + sbu(name) + b"\x93" + arg + b"\x85R."


def shell(cmd: str) -> bytes:
    return sbu(cmd)


GADGETS = {  # name -> payload(canary): each would `touch canary` if unpickled by pickle.loads
    "GLOBAL os.system": lambda c: glob0("os", "system", f"touch {c}"),
    "STACK_GLOBAL posix.system": lambda c: glob4("posix", "system", shell(f"touch {c}")),
    "subprocess.getoutput": lambda c: glob4("subprocess", "getoutput", shell(f"touch {c}")),
    "builtins.eval": lambda c: glob0("builtins", "eval", f"__import__('os').system('touch {c}')"),
    "builtins.exec": lambda c: glob0("builtins", "exec", f"__import__('os').system('touch {c}')"),
    "builtins.getattr(__import__)": lambda c: (
        f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(Vtouch {c}\ntR."
    ).encode(),
    "builtins.__import__ first": lambda c: (
        f"cbuiltins\n__import__\n(Vos\ntRp0\n0cbuiltins\ngetattr\n(g0\nVsystem\ntR(Vtouch {c}\ntR."
    ).encode(),
    # the finding: an admitted prefix re-exports os
    "dcp.filesystem.os module + getattr": lambda c: (
        f"ctorch.distributed.checkpoint.filesystem\nos\np0\n0cbuiltins\ngetattr\n(g0\n"
        f"Vsystem\ntR(Vtouch {c}\ntR."
    ).encode(),
    "dcp.filesystem os.system (dotted)": lambda c: glob4(
        "torch.distributed.checkpoint.filesystem", "os.system", shell(f"touch {c}")
    ),
    "dcp.metadata os.system (admitted module)": lambda c: glob4(
        "torch.distributed.checkpoint.metadata", "os.system", shell(f"touch {c}")
    ),
    "dcp.state_dict_loader os.system": lambda c: glob4(
        "torch.distributed.checkpoint.state_dict_loader", "os.system", shell(f"touch {c}")
    ),
    "_shard.checkpoint.filesystem os.system": lambda c: glob4(
        "torch.distributed._shard.checkpoint.filesystem", "os.system", shell(f"touch {c}")
    ),
    "torch os.system (admitted module)": lambda c: glob4("torch", "os.system", shell(f"touch {c}")),
    "torch.serialization os.system (admitted module)": lambda c: glob4(
        "torch.serialization", "os.system", shell(f"touch {c}")
    ),
    "pathlib os.system (admitted module)": lambda c: glob4(
        "pathlib", "os.system", shell(f"touch {c}")
    ),
    "pathlib PosixPath.touch (admitted class)": lambda c: glob4(
        "pathlib",
        "PosixPath.touch",
        sbu("pathlib") + sbu("PosixPath") + b"\x93" + sbu(str(c)) + b"\x85R",
    ),
    "dcp.filesystem pickle.loads (re-entry)": lambda c: glob4(
        "torch.distributed.checkpoint.filesystem",
        "pickle.loads",
        b"C"
        + bytes([len(glob0("os", "system", f"touch {c}"))])
        + glob0("os", "system", f"touch {c}"),
    ),
    "INST os.system": lambda c: f"(Vtouch {c}\nios\nsystem\n.".encode(),
}


def meta_of(step: Path) -> dict:
    return json.loads((step / "meta.json").read_text())


def rehash(step: Path, meta: dict | None = None) -> None:
    """What an attacker who can write the directory does: make the hash list match."""
    meta = meta or meta_of(step)
    meta["files"] = {
        f: hashlib.sha256((step / f).read_bytes()).hexdigest()
        for f in meta["files"]
        if (step / f).is_file()
    }
    (step / "meta.json").write_text(json.dumps(meta, indent=1))


def edit_meta(fn):
    def go(ck: Path, step: Path, canary: Path, tmp: Path) -> None:
        m = meta_of(step)
        fn(m)
        (step / "meta.json").write_text(json.dumps(m))

    return go


def all_params(meta: dict) -> list[str]:
    from schedc.model.arch import GPTConfig

    return [p.name for p in GPTConfig(**meta["model_config"]).params]


def set_metadata(step: Path, payload: bytes) -> None:
    (step / ".metadata").write_bytes(payload)
    rehash(step)


def real_metadata(step: Path):
    with open(step / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, freshly saved: trusted here


def edit_metadata(fn):
    def go(ck: Path, step: Path, canary: Path, tmp: Path) -> None:
        md = real_metadata(step)
        fn(md, step, canary)
        set_metadata(step, pickle.dumps(md))

    return go


def first_item(md) -> str:
    return next(iter(md.state_dict_metadata))


def restore(md, fqn: str, **changes) -> None:
    for idx, info in list(md.storage_data.items()):
        if idx.fqn == fqn:
            md.storage_data[idx] = dataclasses.replace(info, **changes)


def bytes_item(md, step: Path, canary: Path) -> None:
    """The issue's second finding: a bytes item, whose file DCP would torch.load with
    weights_only=False; the file holds a gadget, listed and hashed in meta.json."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    (step / "__0_1.distcp").write_bytes(glob0("os", "system", f"touch {canary}"))
    m = meta_of(step)
    m["files"]["__0_1.distcp"] = ""
    rehash(step, m)
    fqn = first_item(md)
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    for idx in [i for i in md.storage_data if i.fqn == fqn]:
        del md.storage_data[idx]
    info = next(iter(md.storage_data.values()))
    md.storage_data[MetadataIndex(fqn)] = dataclasses.replace(
        info, relative_path="__0_1.distcp", offset=0, length=(step / "__0_1.distcp").stat().st_size
    )


def not_a_tensor(md, step: Path, canary: Path) -> None:
    """Only allowed classes, but an item that is not a TensorStorageMetadata."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md.state_dict_metadata[first_item(md)] = MetadataIndex("x")


def missing_item(md, step: Path, canary: Path) -> None:
    """A well-formed metadata that lacks an item the model has: DCP itself raises."""
    fqn = first_item(md)
    del md.state_dict_metadata[fqn]
    for idx in [i for i in md.storage_data if i.fqn == fqn]:
        del md.storage_data[idx]


def build_on_class(ck: Path, step: Path, canary: Path, tmp: Path) -> None:
    """BUILD with a slot state on an admitted class object: would rebind Metadata.__repr__."""
    set_metadata(
        step,
        b"\x80\x04"
        + sbu("torch.distributed.checkpoint.metadata")
        + sbu("Metadata")
        + b"\x93N}"
        + sbu("__repr__")
        + sbu("torch.serialization")
        + sbu("_get_layout")
        + b"\x93s\x86b.",
    )


def outside_copy(ck: Path, tmp: Path) -> Path:
    """A complete, valid checkpoint outside the directory being loaded."""
    out = tmp / "outside"
    if not out.exists():
        shutil.copytree(ck / STEP, out / STEP)
    return out / STEP


def latest(text: str):
    def go(ck, step, canary, tmp):
        (ck / "latest").write_text(text + "\n")

    return go


def latest_absolute(ck, step, canary, tmp):
    (ck / "latest").write_text(str(outside_copy(ck, tmp)) + "\n")


def latest_symlinked_dir(ck, step, canary, tmp):
    (ck / "step_00000009").symlink_to(outside_copy(ck, tmp))
    (ck / "latest").write_text("step_00000009\n")


def latest_is_a_link(ck, step, canary, tmp):
    (tmp / "name").write_text(STEP + "\n")
    (ck / "latest").unlink()
    (ck / "latest").symlink_to(tmp / "name")


def fifo(rel: str):
    def go(ck, step, canary, tmp):
        target = ck / rel
        target.unlink()
        os.mkfifo(target)  # a loader that opens it blockingly hangs here forever

    return go


def symlinked(rel: str):
    def go(ck, step, canary, tmp):
        target = ck / rel
        copy = tmp / ("copy-" + target.name)
        shutil.copy(target, copy)  # identical bytes: the hash still matches
        target.unlink()
        target.symlink_to(copy)

    return go


def directory_instead(rel: str):
    def go(ck, step, canary, tmp):
        (ck / rel).unlink()
        (ck / rel).mkdir()

    return go


def listed_file(name: str):
    def go(ck, step, canary, tmp):
        (tmp / "evil.distcp").write_bytes(glob0("os", "system", f"touch {canary}"))
        m = meta_of(step)
        m["files"][name] = hashlib.sha256((tmp / "evil.distcp").read_bytes()).hexdigest()
        (step / "meta.json").write_text(json.dumps(m))

    return go


def raw_meta(text: bytes):
    def go(ck, step, canary, tmp):
        (step / "meta.json").write_bytes(text)

    return go


def huge_meta(ck, step, canary, tmp):
    with open(step / "meta.json", "ab") as f:
        f.truncate(MAX_META_BYTES + 1)  # sparse: no 32 MiB written


def flip_tensor(ck: Path, step: Path) -> None:
    data = step / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[4096] ^= 0xFF  # inside the first tensor (wte)
    data.unlink()  # a new file: copy() hard-links the saved one
    data.write_bytes(bytes(blob))


def flip_and_rehash(ck, step, canary, tmp):
    flip_tensor(ck, step)
    rehash(step)


def gadget_and_rehash(ck, step, canary, tmp):
    set_metadata(step, GADGETS["GLOBAL os.system"](canary))


def renamed_step(ck, step, canary, tmp):
    """A signed checkpoint put under a newer step's name (its HMAC is genuine)."""
    step.rename(ck / "step_00000005")
    (ck / "latest").write_text("step_00000005\n")


def hmac_text(text: str):
    def go(ck, step, canary, tmp):
        (step / HMAC_FILE).write_text(text)

    return go


def remove_hmac(ck, step, canary, tmp):
    (step / HMAC_FILE).unlink()


def rng(v):
    def f(m):
        m["rng"] = [v]

    return f


# -- load-time bombs: small to write, costly to load (each bounded, tests below) -----------------


def meta_to(target: str):
    def go(ck, step, canary, tmp):
        (step / "meta.json").unlink()
        (step / "meta.json").symlink_to(target)

    return go


def sparse(rel: str, size: int):
    def go(ck, step, canary, tmp):
        (ck / rel).unlink()  # a new file: copy() hard-links the saved one
        with open(ck / rel, "wb") as f:
            f.truncate(size)  # nothing written: it costs the attacker no disk

    return go


def deep_tuple(ck, step, canary, tmp):
    """The issue's 1 MB .metadata: one dict holding a tuple nested 10^6 deep (it segfaulted
    the loader), meta.json rehashed."""
    set_metadata(step, b"\x80\x04}" + b")" + b"\x85" * 10**6 + b"K\x01s.")


def repeated_chunks(md, step: Path, canary: Path) -> None:
    """wte's chunk entry 20,000 times (32 s to load before, growing with the count)."""
    v = md.state_dict_metadata["param.wte.weight"]
    v.chunks = v.chunks * 20_000


def deflated_record(ck, step, canary, tmp):
    """A record that inflates: torch.save of a 256 MiB tensor, its data deflated to a few
    hundred KB and padded to wte's size so its length looks right, appended to the data
    file, wte's storage pointed at it, everything rehashed."""
    import io as _io
    import zipfile

    md = real_metadata(step)
    fqn = "param.wte.weight"
    n = 4 * torch.Size(md.state_dict_metadata[fqn].size).numel()
    raw = _io.BytesIO()
    torch.save(torch.zeros(64 << 20), raw)

    def pack(pad: int) -> bytes:
        packed = _io.BytesIO()
        with zipfile.ZipFile(raw) as src, zipfile.ZipFile(packed, "w") as out:
            for info in src.infolist():
                out.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
            if pad:
                out.writestr("archive/pad", b"\0" * pad)  # stored: the length looks right
        return packed.getvalue()

    record = pack(max(0, n - len(pack(0))))
    assert n <= len(record) <= n + RECORD_SLACK  # passes the length check
    data = step / "__0_0.distcp"
    blob = data.read_bytes()
    data.unlink()
    data.write_bytes(blob + record)
    restore(md, fqn, offset=len(blob), length=len(record))
    set_metadata(step, pickle.dumps(md))


A = SimpleNamespace
BOMBS = {
    "bomb: meta.json a symlink to /dev/zero": A(do=meta_to("/dev/zero"), file=f"{STEP}/meta.json"),
    "bomb: meta.json sparse 2 GiB": A(
        do=sparse(f"{STEP}/meta.json", 2 << 30), file=f"{STEP}/meta.json"
    ),
    "bomb: meta.json a FIFO": A(do=fifo(f"{STEP}/meta.json"), file=f"{STEP}/meta.json"),
    "bomb: .metadata a tuple nested 10^6 deep": A(do=deep_tuple, file=f"{STEP}/.metadata"),
    "bomb: a chunk entry repeated 20,000 times": A(
        do=edit_metadata(repeated_chunks), file=f"{STEP}/.metadata"
    ),
    "bomb: a deflated record": A(do=deflated_record, file=f"{STEP}/__0_0.distcp"),
    "bomb: an 8 GiB sparse .distcp": A(
        do=sparse(f"{STEP}/__0_0.distcp", 8 << 30), file=f"{STEP}/__0_0.distcp"
    ),
}
ATTACKS = {
    **BOMBS,
    # pickle gadgets in .metadata, meta.json's hash list rewritten to match
    **{
        f"gadget: {name}": A(
            do=lambda ck, step, canary, tmp, p=p: set_metadata(step, p(canary)),
            file=f"{STEP}/.metadata",
        )
        for name, p in GADGETS.items()
    },
    "BUILD on an admitted class": A(do=build_on_class, file=f"{STEP}/.metadata"),
    "bytes item (BytesStorageMetadata)": A(do=edit_metadata(bytes_item), file=f"{STEP}/.metadata"),
    "bytes item made of allowed classes": A(
        do=edit_metadata(not_a_tensor), file=f"{STEP}/.metadata"
    ),
    "item schedc never writes": A(
        do=edit_metadata(
            lambda md, s, c: md.state_dict_metadata.update(
                rng_state=md.state_dict_metadata[first_item(md)]
            )
        ),
        file=f"{STEP}/.metadata",
    ),
    "storage file ../../x.distcp": A(
        do=edit_metadata(
            lambda md, s, c: restore(md, first_item(md), relative_path="../../x.distcp")
        ),
        file=f"{STEP}/.metadata",
    ),
    "storage file absolute": A(
        do=edit_metadata(lambda md, s, c: restore(md, first_item(md), relative_path="/etc/passwd")),
        file=f"{STEP}/.metadata",
    ),
    "storage file .metadata": A(
        do=edit_metadata(lambda md, s, c: restore(md, first_item(md), relative_path=".metadata")),
        file=f"{STEP}/.metadata",
    ),
    "storage past the file's end": A(
        do=edit_metadata(lambda md, s, c: restore(md, first_item(md), offset=1 << 40)),
        file=f"{STEP}/.metadata",
    ),
    "storage stream transform": A(
        do=edit_metadata(
            lambda md, s, c: restore(md, first_item(md), transform_descriptors=["zstd"])
        ),
        file=f"{STEP}/.metadata",
    ),
    "DCP raises (an item missing)": A(do=edit_metadata(missing_item), file=STEP),
    # `latest`
    "latest ../outside": A(do=latest(f"../outside/{STEP}"), file="latest"),
    "latest absolute": A(do=latest_absolute, file="latest"),
    "latest step_ symlink to outside": A(do=latest_symlinked_dir, file="latest"),
    "latest not step_*": A(do=latest("foo"), file="latest"),
    "latest step_/../step_": A(do=latest(f"{STEP}/../{STEP}"), file="latest"),
    "latest is a symlink": A(do=latest_is_a_link, file="latest"),
    "latest is a FIFO": A(do=fifo("latest"), file="latest"),
    # meta.json's file list and the files themselves
    "files: ../evil.distcp": A(do=listed_file("../evil.distcp"), file=f"{STEP}/meta.json"),
    "files: absolute path": A(do=listed_file("/tmp/evil.distcp"), file=f"{STEP}/meta.json"),
    "files: not a DCP name": A(do=listed_file("evil.pt"), file=f"{STEP}/meta.json"),
    "data file is a symlink": A(do=symlinked(f"{STEP}/__0_0.distcp"), file=f"{STEP}/__0_0.distcp"),
    ".metadata is a symlink": A(do=symlinked(f"{STEP}/.metadata"), file=f"{STEP}/.metadata"),
    "meta.json is a symlink": A(do=symlinked(f"{STEP}/meta.json"), file=f"{STEP}/meta.json"),
    "data file is a FIFO": A(do=fifo(f"{STEP}/__0_0.distcp"), file=f"{STEP}/__0_0.distcp"),
    "meta.json is a FIFO": A(do=fifo(f"{STEP}/meta.json"), file=f"{STEP}/meta.json"),
    "data file is a directory": A(
        do=directory_instead(f"{STEP}/__0_0.distcp"), file=f"{STEP}/__0_0.distcp"
    ),
    # meta.json's schema
    "schema: no files": A(do=edit_meta(lambda m: m.pop("files")), file=f"{STEP}/meta.json"),
    "schema: files a list": A(
        do=edit_meta(lambda m: m.update(files=[".metadata"])), file=f"{STEP}/meta.json"
    ),
    "schema: step a string": A(
        do=edit_meta(lambda m: m.update(step="1")), file=f"{STEP}/meta.json"
    ),
    "schema: step huge": A(do=edit_meta(lambda m: m.update(step=10**30)), file=f"{STEP}/meta.json"),
    "schema: world 0": A(do=edit_meta(lambda m: m.update(world=0)), file=f"{STEP}/meta.json"),
    "schema: format 3": A(do=edit_meta(lambda m: m.update(format=3)), file=f"{STEP}/meta.json"),
    "schema: format 2 without its stream": A(
        do=edit_meta(lambda m: m.pop("stream")), file=f"{STEP}/meta.json"
    ),
    "schema: stream data not hex": A(
        do=edit_meta(lambda m: m["stream"].update(data="../../etc/passwd")),
        file=f"{STEP}/meta.json",
    ),
    "schema: stream sequences negative": A(
        do=edit_meta(lambda m: m["stream"].update(sequences=-1)), file=f"{STEP}/meta.json"
    ),
    "schema: stream with an extra key": A(
        do=edit_meta(lambda m: m["stream"].update(code="os.system")), file=f"{STEP}/meta.json"
    ),
    "schema: extra key": A(
        do=edit_meta(lambda m: m.update(exec="os.system")), file=f"{STEP}/meta.json"
    ),
    "schema: model_config string": A(
        do=edit_meta(lambda m: m["model_config"].update(n_layer="4")), file=f"{STEP}/meta.json"
    ),
    "schema: negative unit": A(
        do=edit_meta(lambda m: m.update(units={"u1": -1})), file=f"{STEP}/meta.json"
    ),
    "schema: unit_params of no unit": A(
        do=edit_meta(lambda m: m.update(unit_params={"u1": ["wte.weight"]})),
        file=f"{STEP}/meta.json",
    ),
    "schema: unit_params not adding up": A(
        do=edit_meta(lambda m: m.update(units={"all": 5}, unit_params={"all": all_params(m)})),
        file=f"{STEP}/meta.json",
    ),
    "schema: hash not hex": A(
        do=edit_meta(lambda m: m["files"].update({".metadata": "x"})), file=f"{STEP}/meta.json"
    ),
    "schema: rng not base64": A(do=edit_meta(rng("not base64!")), file=f"{STEP}/meta.json"),
    "schema: rng wrong length": A(
        do=edit_meta(rng(base64.b64encode(b"0" * 10).decode())), file=f"{STEP}/meta.json"
    ),
    "schema: rng of two ranks": A(
        do=edit_meta(lambda m: m.update(rng=m["rng"] * 2)), file=f"{STEP}/meta.json"
    ),
    "schema: malformed JSON": A(do=raw_meta(b'{"format": 1,'), file=f"{STEP}/meta.json"),
    "schema: a JSON array": A(do=raw_meta(b"[1, 2]"), file=f"{STEP}/meta.json"),
    "schema: not UTF-8": A(do=raw_meta(b"\xff\xfe{}"), file=f"{STEP}/meta.json"),
    "schema: over the size bound": A(do=huge_meta, file=f"{STEP}/meta.json"),
    "schema: step not the directory's": A(
        do=edit_meta(lambda m: m.update(step=7)), file=f"{STEP}/meta.json"
    ),
    # hashes and the key
    "tensor altered, hashes kept": A(
        do=lambda ck, step, c, t: flip_tensor(ck, step), file=f"{STEP}/__0_0.distcp"
    ),
    "keyed: tensor altered and rehashed": A(
        do=flip_and_rehash, file=f"{STEP}/{HMAC_FILE}", src="keyed", key=KEY
    ),
    "keyed: gadget and rehashed": A(
        do=gadget_and_rehash, file=f"{STEP}/{HMAC_FILE}", src="keyed", key=KEY
    ),
    "keyed: an older signed checkpoint renamed": A(
        do=renamed_step, file="step_00000005/meta.json", src="keyed", key=KEY
    ),
    "keyed: HMAC removed": A(do=remove_hmac, file=f"{STEP}/{HMAC_FILE}", src="keyed", key=KEY),
    "keyed: HMAC garbage": A(
        do=hmac_text("hmac-sha256:" + "0" * 64), file=f"{STEP}/{HMAC_FILE}", src="keyed", key=KEY
    ),
    "keyed: HMAC is a symlink": A(
        do=symlinked(f"{STEP}/{HMAC_FILE}"), file=f"{STEP}/{HMAC_FILE}", src="keyed", key=KEY
    ),
    "keyed: another key": A(
        do=lambda *a: None, file=f"{STEP}/{HMAC_FILE}", src="keyed", key=OTHER_KEY
    ),
    "keyed: loaded without a key": A(do=lambda *a: None, file=f"{STEP}/{HMAC_FILE}", src="keyed"),
    "plain: loaded with a key": A(do=lambda *a: None, file=f"{STEP}/{HMAC_FILE}", key=KEY),
}


def copy(saved, src: str, tmp: Path) -> tuple[Path, Path]:
    """A copy of a saved checkpoint; its 16 MB tensor file hard-linked (attacks that change
    it replace it, never write into it)."""
    ck = tmp / "ck"
    shutil.copytree(
        saved.base / src,
        ck,
        symlinks=True,
        copy_function=lambda a, b: (os.link if a.endswith(".distcp") else shutil.copy2)(a, b),
    )
    return ck, ck / STEP


@pytest.fixture
def bounded():
    """Fail, not hang, should a loader block (on a FIFO): SIGALRM after 60 s."""

    def boom(*_):
        raise TimeoutError("the loader blocked")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("name", ATTACKS)
def test_an_attack_is_a_clear_error_and_runs_nothing(saved, tmp_path, bounded, name):
    from torch.distributed.checkpoint.metadata import Metadata

    attack = ATTACKS[name]
    ck, step = copy(saved, getattr(attack, "src", "plain"), tmp_path)
    canary = tmp_path / "canary"
    attack.do(ck, step, canary, tmp_path)
    with pytest.raises(CheckpointError) as e:
        store.load(saved.ex, ck, key=getattr(attack, "key", None))
    msg = str(e.value)
    assert str(ck / attack.file) in msg, msg  # names the offending file
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert not canary.exists()
    assert Metadata.__repr__ is not torch.serialization._get_layout  # no class was rebuilt


@pytest.mark.parametrize("name", GADGETS)
def test_each_gadget_is_live(tmp_path, name):
    """The control: Python's own unpickler runs each gadget (so refusing it means something)."""
    canary = tmp_path / "canary"
    pickle.loads(GADGETS[name](canary))
    assert canary.exists()


def test_there_are_at_least_30_attacks():
    assert len(ATTACKS) >= 30


@pytest.mark.parametrize("src,key", [("plain", None), ("keyed", KEY)])
def test_an_untouched_checkpoint_loads(saved, tmp_path, src, key):
    ck, _ = copy(saved, src, tmp_path)
    assert store.load(saved.ex, ck, key=key) == 1
    for k, v in saved.ex.params.items():
        assert torch.equal(v, saved.params[k]), k


def test_without_a_key_a_rewritten_tensor_and_hash_list_go_unnoticed(saved, tmp_path):
    """What the README says the hashes do not promise: an attacker who rewrites a tensor file
    and its hash in meta.json is not detected without --checkpoint-key (the test above with
    a key is "keyed: tensor altered and rehashed")."""
    ck, step = copy(saved, "plain", tmp_path)
    flip_and_rehash(ck, step, None, tmp_path)
    assert store.load(saved.ex, ck) == 1
    assert any(not torch.equal(v, saved.params[k]) for k, v in saved.ex.params.items())
    store.load(saved.ex, saved.base / "plain")  # back to the saved state


def test_a_short_key_file_is_refused(tmp_path):
    (tmp_path / "k").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="at least 16 bytes"):
        files.read_key(tmp_path / "k")


@pytest.mark.faults
@pytest.mark.parametrize(
    "name",
    [
        "gadget: GLOBAL os.system",
        "DCP raises (an item missing)",
        "bomb: meta.json a FIFO",  # read by the start-up agreement, before any verification
        "bomb: .metadata a tuple nested 10^6 deep",  # exited 139 with no output
    ],
)
def test_the_cli_says_one_line_and_exits_1(saved, tmp_path, name):
    ck, step = copy(saved, "plain", tmp_path)
    canary = tmp_path / "canary"
    ATTACKS[name].do(ck, step, canary, tmp_path)
    # --steps 1: the LR schedule it was saved on (a resume on another is refused, rightly)
    run = ["run", "schedules/tiny_1gpu.sched", "--steps", "1", "--resume", str(ck)]
    p = python("-m", "schedc", *run, env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("schedc: error: "), p.stderr
    assert str(ck / ATTACKS[name].file) in lines[0]
    assert "Traceback" not in p.stderr and not canary.exists()


# each bomb in a fresh process: refused within 5 s and 300 MB above what the loader held
BOUNDED = r"""
import json, resource, sys, time
import torch.distributed as dist
from schedc.compiler import compile_file
from schedc.exec.checkpoint import store
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from schedc.lang.resolve import Overrides
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
c = compile_file("schedules/tiny_1gpu.sched", Overrides(steps=1))
ex = Executor(c, Comm(0, 1), RunOptions(device="cpu", log=False))
out = {}
for name, ck in json.loads(sys.argv[1]).items():
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        store.load(ex, ck)
        said = "loaded"
    except store.CheckpointError as e:
        said = str(e)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    out[name] = {"s": time.perf_counter() - t0, "mb": grew / 1024, "said": said}
print(json.dumps(out))
"""


def test_each_bomb_is_refused_within_5_s_and_300_mb(saved, tmp_path):
    cks = {}
    for i, (name, bomb) in enumerate(BOMBS.items()):
        ck, step = copy(saved, "plain", tmp_path / str(i))
        bomb.do(ck, step, tmp_path / "canary", tmp_path)
        cks[name] = str(ck)
    p = python("-c", BOUNDED, json.dumps(cks), env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]  # no segfault, no traceback
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, bomb in BOMBS.items():
        r = got[name]
        print(f"{name}: {r['s']:.2f} s, +{r['mb']:.0f} MB: {r['said']}")
        assert str(Path(cks[name]) / bomb.file) in r["said"] and "\n" not in r["said"], r
        assert r["s"] <= 5 and r["mb"] <= 300, (name, r)
