"""Hugging Face GPT-2 weights in and out: `schedc run --init hf:DIR` and `schedc export`.

    schedc run s.sched --init hf:DIR        DIR/config.json + model.safetensors (or
                                            pytorch_model.bin) become the weights of step 0
    schedc export CKPT -o DIR               a checkpoint's weights become DIR/config.json +
                                            model.safetensors for GPT2LMHeadModel

The names, the transposed Conv1D matrices and config.json are schedc/model/hf.py's.

What is read never runs code. model.safetensors is read by safetensors (a JSON header and
raw bytes). pytorch_model.bin, a pickle, is read only by torch.load(weights_only=True), whose
unpickler builds tensors, containers and numbers and refuses any other global, so a pickle
that would call os.system is refused before anything is called; a zip archive whose entries
are compressed, or declare more bytes than the model can hold, is refused before torch
inflates it (the rule of checkpoint records, exec/checkpoint/dcp_metadata.py). The file is
bounded by the model's size (stat) before a byte is read or hashed. A symbolic link is
followed, as Hugging Face's cache needs (snapshots/REV/model.safetensors -> ../../blobs/SHA),
to a regular file only: never a FIFO or a device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from schedc.errors import UserError
from schedc.model.arch import GPTConfig
from schedc.model.hf import (
    CONFIG,
    SAFETENSORS,
    TIED,
    HFError,
    check_config,
    check_weights,
    export_config,
    hf_name,
    hf_shape,
    max_weight_bytes,
    read_config,
    schedc_name,
    transposed,
    weights_file,
)

# -- in -----------------------------------------------------------------------------------------


def source(directory: Path) -> str:
    """What every rank must agree on before step 1: the directory and a hash of its config
    and weights, so ranks on nodes with different copies disagree (read_config and
    weights_file say what is missing, as a user error). The weights' size was bounded by
    the schedule's model before (cli/run.py: weights_file with the model), so what is
    hashed here is at most what a model of its sizes holds."""
    read_config(directory)
    h = hashlib.sha256()
    for path in (directory / CONFIG, weights_file(directory)):
        with os.fdopen(_open(path), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return f"hf:{directory.resolve()} (sha256 {h.hexdigest()[:16]})"


def load(directory: Path, model: GPTConfig, name: str) -> dict[str, torch.Tensor]:
    """The weights of DIR as schedc's parameters, by name, in schedc's shapes; config.json
    is checked against the schedule's model (`name`) before the weights are read, and the
    weights' size before a byte of them is."""
    check_config(read_config(directory), directory / CONFIG, model, name)
    path = weights_file(directory, model)
    fd = _open(path)
    try:  # again, of what was opened: the file may have been replaced since
        check_weights(path, os.fstat(fd), model)
    finally:
        os.close(fd)
    tensors = _read_safetensors(path) if path.name == SAFETENSORS else _read_pickle(path, model)
    return _to_schedc(tensors, model, path)


def _open(path: Path) -> int:
    """A descriptor of the regular file `path` names. A link is followed: a model directory
    is the user's, not a checkpoint (whose files must lie inside it), and Hugging Face's
    cache is links to blobs. O_NONBLOCK keeps the open of a FIFO from waiting for a
    writer; fstat then refuses anything but a regular file (a FIFO, /dev/zero)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise HFError(f"{path}: cannot be opened: {e.strerror or e}") from None
    try:
        check_weights(path, os.fstat(fd), None)
    except HFError:
        os.close(fd)
        raise
    return fd


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise HFError(f"{path}: reading it needs safetensors (pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors' errors are about this file
        raise HFError(f"{path}: not a safetensors file: {_first_line(e)}") from None


def _read_pickle(path: Path, model: GPTConfig) -> dict[str, torch.Tensor]:
    """A torch.save file, through torch's weights-only unpickler only."""
    _check_zip(path, model)
    try:
        with warnings.catch_warnings():  # a protocol note, printed before the refusal
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as e:  # noqa: BLE001 - whatever the file makes torch.load raise
        raise HFError(
            f"{path}: refused: not weights only, and schedc never unpickles anything else "
            f"(torch.load(weights_only=True): {_reason(e)}); convert it to model.safetensors "
            "where you trust it"
        ) from None


def _check_zip(path: Path, model: GPTConfig) -> None:
    """A torch.save archive stores its records as they are: a compressed one, or records that
    declare more than the model can hold, are refused before torch.load inflates them."""
    if not zipfile.is_zipfile(path):
        return  # the legacy format: a plain pickle, which the weights-only unpickler reads
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise HFError(f"{path}: not a file torch.save wrote: {e}") from None
    packed = any(i.compress_type != zipfile.ZIP_STORED for i in infos)
    if packed or sum(i.file_size for i in infos) > max_weight_bytes(model):
        raise HFError(
            f"{path}: refused: its records are compressed or larger than the model; "
            "torch.save stores tensors as they are"
        )


def _reason(e: BaseException) -> str:
    """torch's refusal without its advice to load with weights_only=False."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith(boiler) and not ln.endswith("error:")]
    return (said or lines or [type(e).__name__])[0][:200]


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _to_schedc(tensors: object, model: GPTConfig, path: Path) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors by schedc's names, Conv1D weights transposed; every parameter
    once, of its shape, nothing else but the tied head (equal to wte) and mask buffers."""
    if not isinstance(tensors, dict) or not all(
        type(k) is str and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise HFError(f"{path}: not a state dict of tensors by name")
    shapes = {p.name: p.shape for p in model.params}
    out: dict[str, torch.Tensor] = {}
    head = None
    for key, t in tensors.items():
        name = schedc_name(key)
        if name == TIED:
            head = t
        elif name is not None:
            out[_one(out, name, key, path, shapes)] = _placed(t, name, key, path, shapes)
    missing = [n for n in shapes if n not in out]
    if missing:
        raise HFError(f"{path}: no {hf_name(missing[0])} (nor {missing[0]})")
    if head is not None and not torch.equal(head, out["wte.weight"].to(head.dtype)):
        raise HFError(f"{path}: {TIED} differs from wte.weight; schedc's GPT-2 ties them")
    return out


def _one(out: dict, name: str, key: str, path: Path, shapes: dict) -> str:
    if name not in shapes:
        raise HFError(f"{path}: {key} is not a weight of schedc's GPT-2")
    if name in out:
        raise HFError(f"{path}: {name} twice (with and without the `transformer.` prefix)")
    return name


def _placed(t: torch.Tensor, name: str, key: str, path: Path, shapes: dict) -> torch.Tensor:
    """A tensor in schedc's layout, its shape checked in Hugging Face's."""
    want = hf_shape(shapes[name], name)
    if tuple(t.shape) != want or not t.is_floating_point():
        raise HFError(
            f"{path}: {key} is {t.dtype} {tuple(t.shape)}; the schedule's model needs "
            f"a floating-point {want}"
        )
    return (t.t() if transposed(name) else t).contiguous()


# -- out ----------------------------------------------------------------------------------------


def export(checkpoint: str, out: Path, key: bytes | None = None) -> str:
    """Write a checkpoint's weights as a Hugging Face GPT-2 directory; returns what was
    written, for the CLI to say."""
    from schedc.exec.checkpoint import store  # DCP: a second to import

    meta, model, params = store.read_parameters(checkpoint, key)
    dtype = str(params["wte.weight"].dtype).removeprefix("torch.")
    tensors = {hf_name(n): (t.t() if transposed(n) else t).contiguous() for n, t in params.items()}
    written = write(out, tensors, json.dumps(export_config(model, dtype), indent=2) + "\n")
    return (
        f"schedc: exported step {meta['step']} of {checkpoint} ({meta['strategy']}, world "
        f"{meta['world']}, model {meta['model']}: {model.numel:,} parameters, {dtype}) to "
        f"{out}: {', '.join(written)}; load it with "
        f"transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})"
    )


def write(out: Path, tensors: dict[str, torch.Tensor], config: str) -> list[str]:
    """DIR/config.json and DIR/model.safetensors, each written whole or not at all: into a
    temporary file beside it, renamed over it; a failure removes the temporary file. Each
    gets the mode a new file gets under the umask (safetensors itself writes 0600)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("schedc export writes safetensors: pip install safetensors") from None
    try:
        out.mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(f"-o {out}: cannot write: {e.strerror or e}") from None
    _write_whole(
        out,
        SAFETENSORS,
        lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),  # transformers': pt
    )
    _write_whole(out, CONFIG, lambda tmp: tmp.write_text(config))
    return [CONFIG, SAFETENSORS]


def _write_whole(out: Path, name: str, write: Callable[[Path], object]) -> None:
    """out/name written by `write` into .name.tmp, given a new file's mode, renamed."""
    tmp = out / f".{name}.tmp"
    try:
        tmp.unlink(missing_ok=True)  # a crashed export's
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # 0o666 less the umask, as any new file
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, out / name)
    except OSError as e:
        raise UserError(f"-o {out}: cannot write {name}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):  # renamed: nothing is left to remove
            tmp.unlink()
