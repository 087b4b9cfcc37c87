"""meta.json, the checkpoint's index, trusted only once checked: its HMAC with a key, then
its schema field by field, then every file it lists against its SHA-256.

meta.json holds the step (which fixes the learning rate and the data position: step s
reads global batch s), the schedule and model it was saved by (FSDP: each unit's size and
its parameters in the order its flat parameter holds them, so that a reader needs no
schedule to cut it up), each rank's RNG state, and the SHA-256 of every other file. The
hashes detect corruption and truncation, not tampering: with a key, meta.json.hmac
authenticates meta.json's exact bytes, and through its hashes every file.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from schedc.exec.checkpoint.files import hash_file, mac, read_bounded
from schedc.exec.checkpoint.layout import (
    DCP_FILE,
    FORMATS,
    HEX16,
    HEX64,
    HMAC_FILE,
    MAX_FILES,
    MAX_META_BYTES,
    MAX_UNITS,
    MAX_WORLD,
    STEP_DIR,
    STRATEGIES,
    CheckpointError,
    step_dir,
)


def verify(path: Path, key: bytes | None = None) -> dict:
    """Check the HMAC (with a key), meta.json's schema, and every file's hash; no byte of the
    checkpoint is used before. Returns meta.json, with the files' sizes under "_sizes"."""
    meta = read_meta(path, key)
    limit = _largest(meta, path / "meta.json")
    sizes = {}
    for fname, want in meta["files"].items():
        got, sizes[fname] = hash_file(path / fname, limit)
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
    raw = read_bounded(where, MAX_META_BYTES, "meta.json")
    _check_hmac(path / HMAC_FILE, raw, key)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: not valid JSON: nested too deeply") from None
    _check_meta(meta, where)
    if STEP_DIR.fullmatch(path.name) and path.name != step_dir(meta["step"]):
        raise CheckpointError(
            f"{where}: field 'step': {meta['step']}, but the directory is {path.name} (renamed?)"
        )
    return meta


def _check_hmac(mac_file: Path, raw: bytes, key: bytes | None) -> None:
    """With a key, meta.json.hmac must exist and match meta.json's bytes; without one it
    must not exist (a keyed checkpoint is never loaded unchecked)."""
    if key is None:
        if os.path.lexists(mac_file):
            raise CheckpointError(
                f"{mac_file}: this checkpoint was saved with --checkpoint-key; "
                "give the same key to load it"
            )
        return
    if not os.path.lexists(mac_file):
        raise CheckpointError(
            f"{mac_file}: missing, so --checkpoint-key cannot check this "
            "checkpoint (saved without a key, or the HMAC was removed)"
        )
    got = read_bounded(mac_file, 256, "an HMAC").decode("ascii", "replace").strip()
    if not hmac.compare_digest(got, mac(key, raw)):
        raise CheckpointError(
            f"{mac_file}: the HMAC of meta.json does not match this key "
            "(another key, or meta.json was altered)"
        )


# -- meta.json's schema -------------------------------------------------------------------------
#
# One check a field, in the order they are reported: each returns the first problem it finds
# as (the field or element named, what is wrong), or None. A check runs only after every
# field before it passed, so `rng` may read a checked `world`.

Problem = tuple[str, str] | None
_UNKNOWN = "not a field of a schedc checkpoint"
FORMAT_2_FIELDS = {"stream", "unit_params"}  # what a format-1 checkpoint does not have


def _check_meta(meta: Any, where: Path) -> None:
    """meta.json's schema, field by field: exactly the keys save() writes, each of its type
    and in range; files are DCP's own names, directly in the directory."""
    if type(meta) is not dict:
        raise CheckpointError(f"{where}: not a JSON object")
    needed = _FIELDS.keys() - (FORMAT_2_FIELDS if meta.get("format") == 1 else set())
    problem = (
        next(((k, "missing") for k in sorted(needed - meta.keys())), None)
        or next(((k[:40], _UNKNOWN) for k in sorted(meta.keys() - _FIELDS.keys())), None)
        or next(
            (p for field in _FIELDS if field in meta and (p := _FIELDS[field](meta[field], meta))),
            None,
        )
    )
    if problem is not None:
        field, what = problem
        raise CheckpointError(f"{where}: field '{field}': {what}")


def _integer(field: str, v: Any, lo: int, hi: int) -> Problem:
    if type(v) is not int or not lo <= v <= hi:
        return field, f"{str(v)[:40]!r} is not an integer in [{lo}, {hi}]"
    return None


def _sizes(field: str, v: dict, hi: int) -> Problem:
    """Every value of an object of sizes is an integer in [0, hi]."""
    return next((p for k, n in v.items() if (p := _integer(f"{field}.{k[:40]}", n, 0, hi))), None)


def _hex64(field: str, v: Any) -> Problem:
    if type(v) is not str or not HEX64.fullmatch(v):
        return field, "not a SHA-256 in hex"
    return None


def _format(v: Any, meta: dict) -> Problem:
    if type(v) is not int or v not in FORMATS:
        return "format", f"{str(v)[:20]}, expected one of {', '.join(map(str, FORMATS))}"
    return None


def _stream(v: Any, meta: dict) -> Problem:
    """Which token stream the run read, and how far: the data's fingerprint, the sequences
    read (step x global batch), and the step the LR's cosine decay ends at."""
    keys = {"data", "sequences", "lr_horizon"}
    if type(v) is not dict or v.keys() != keys:
        return "stream", f"not an object of {', '.join(sorted(keys))}"
    if type(v["data"]) is not str or not HEX16.fullmatch(v["data"]):
        return "stream.data", "not a data fingerprint (16 hex digits)"
    return _integer("stream.sequences", v["sequences"], 0, 2**62) or _integer(
        "stream.lr_horizon", v["lr_horizon"], 0, 2**30
    )


def _strategy(v: Any, meta: dict) -> Problem:
    if v not in STRATEGIES:
        return "strategy", f"{str(v)[:40]!r} is not one of {', '.join(STRATEGIES)}"
    return None


def _model(v: Any, meta: dict) -> Problem:
    if type(v) is not str or not 0 < len(v) <= 100:
        return "model", "not a model name"
    return None


def _model_config(v: Any, meta: dict) -> Problem:
    if type(v) is not dict or len(v) > 64:
        return "model_config", "not an object of model sizes"
    return _sizes("model_config", v, 2**40)


def _units(v: Any, meta: dict) -> Problem:
    if type(v) is not dict or len(v) > MAX_UNITS:
        return "units", f"not an object of at most {MAX_UNITS} unit sizes"
    return _sizes("units", v, 2**48)


def _unit_params(v: Any, meta: dict) -> Problem:
    """Each unit's parameter names in its flat parameter's order: the model's parameters,
    each in one unit once, adding up to the unit's size ({} without units)."""
    units = meta["units"]
    if type(v) is not dict or v.keys() != units.keys():
        return "unit_params", "not an object of the parameters of each of 'units'"
    try:
        from schedc.model.arch import GPTConfig

        sizes = {p.name: p.numel for p in GPTConfig(**meta["model_config"]).params}
    except (TypeError, ValueError):
        return "model_config", "not a GPT-2 configuration"
    held = [n for names in v.values() for n in (names if type(names) is list else [None])]
    if v and sorted(held, key=str) != sorted(sizes):
        return "unit_params", "does not name every parameter of the model once"
    for u, names in v.items():
        if sum(sizes[n] for n in names) != units[u]:
            return f"unit_params.{u[:40]}", f"its parameters do not add up to {units[u]} elements"
    return None


def _rng(v: Any, meta: dict) -> Problem:
    if type(v) is not list or len(v) != meta["world"]:
        return "rng", f"not a list of {meta['world']} RNG states (one a rank)"
    n = torch.get_rng_state().numel()
    for r, state in enumerate(v):
        if not _is_base64_of(state, n):
            return f"rng[{r}]", f"not the base64 of a {n}-byte RNG state"
    return None


def _is_base64_of(state: Any, n: int) -> bool:
    try:
        return type(state) is str and len(base64.b64decode(state, validate=True)) == n
    except ValueError:
        return False


def _files(v: Any, meta: dict) -> Problem:
    if type(v) is not dict or not 0 < len(v) <= MAX_FILES:
        return "files", f"not an object of 1 to {MAX_FILES} file hashes"
    for fname, h in v.items():
        if not DCP_FILE.fullmatch(fname):
            return "files", f"{fname[:60]!r} is not a file DCP writes (.metadata, __R_N.distcp)"
        if p := _hex64(f"files[{fname!r}]", h):
            return p
    if ".metadata" not in v:
        return "files", "does not list .metadata"
    return None


# every field save() writes, and its check, in the order they are checked
_FIELDS: dict[str, Callable[[Any, dict], Problem]] = {
    "format": _format,
    "step": lambda v, meta: _integer("step", v, 0, 10**12),
    "world": lambda v, meta: _integer("world", v, 1, MAX_WORLD),
    "strategy": _strategy,
    "model": _model,
    "model_config": _model_config,
    "schedule_sha256": lambda v, meta: _hex64("schedule_sha256", v),
    "units": _units,
    "unit_params": _unit_params,
    "rng": _rng,
    "stream": _stream,
    "files": _files,
}
