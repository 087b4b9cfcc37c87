"""The unpickler DCP's `.metadata` is read with: it admits exactly what a schedc checkpoint
pickles, and nothing that creates or calls anything else.

It admits the globals DCP's metadata of a schedc checkpoint pickles (recorded from DDP,
FSDP and single-process saves at worlds 1 and 2), by (module, name), never by prefix or
dotted path; calls (REDUCE) only the four factories among them; builds (NEWOBJ, BUILD) only
instances of the seven metadata dataclasses with their own fields; and refuses every other
opcode that creates or calls. It is Python's own pure-Python unpickler with those dispatch
entries replaced, and bounded in depth and size.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from collections.abc import Callable, Iterable
from pathlib import PosixPath
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from schedc.exec.checkpoint.layout import DTYPES

# One entry of pickle's dispatch table: an opcode's loader, given the unpickler. Python's own
# loaders, as the pure-Python unpickler has them.
Loader = Callable[[Any], None]
PICKLE: dict[int, Loader] = dict(pickle._Unpickler.dispatch)


class MetadataUnpickler(pickle._Unpickler):
    """pickle's unpickler, admitting only a schedc checkpoint's DCP metadata."""

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
            *(("torch", str(d).removeprefix("torch.")) for d in DTYPES),
        }
    )
    # Resource bounds. schedc's metadata nests 7 deep (Metadata, dict, item, list, chunk,
    # Size, int) and holds a few objects per tensor (GPT-2 FSDP at world 8: under 10,000);
    # a tuple nested 10^6 deep in 1 MB crashed the interpreter when freed or compared.
    MAX_DEPTH = 32
    MAX_OBJECTS = 200_000
    # the pure-Python unpickler's state, which typeshed does not declare
    stack: list[Any]
    metastack: list[list[Any]]

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._depth: dict[int, int] = {}
        self._alive: list[object] = []  # every container made, so no id() is reused while loading

    def nest(self, obj: object, children: Iterable[object]) -> None:
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

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"metadata names {module}.{name}, which a DCP checkpoint never does"
            )
        return getattr(importlib.import_module(module), name)  # name has no dot: exact

    def refuse(self, what: str) -> NoReturn:
        raise pickle.UnpicklingError(
            f"metadata uses pickle's {what}, which a DCP checkpoint never does"
        )

    def load_reduce_checked(self) -> None:
        if not any(self.stack[-2] is f for f in _factories()):
            self.refuse(f"REDUCE on {_name(self.stack[-2])}")
        PICKLE[pickle.REDUCE[0]](self)

    def load_newobj_checked(self) -> None:
        if not any(self.stack[-2] is c for c in _classes()):
            self.refuse(f"NEWOBJ of {_name(self.stack[-2])}")
        PICKLE[pickle.NEWOBJ[0]](self)

    def load_build_checked(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]
        cls = type(inst)
        if not any(cls is c for c in _classes()):
            self.refuse(f"BUILD on {_name(inst)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        ok = (
            type(state) is tuple and len(state) == 5
            if cls is TensorProperties
            else type(state) is dict and all(type(k) is str and k in fields for k in state)
        )
        if not ok:
            self.refuse(f"BUILD of {cls.__name__} with a state it never has")
        PICKLE[pickle.BUILD[0]](self)


def _made(load: Loader) -> Loader:
    """A container from the stack (TUPLE, LIST, DICT, ...): nested one below its items."""

    def made(self: MetadataUnpickler) -> None:
        load(self)
        top = self.stack[-1]
        items = [*top.keys(), *top.values()] if type(top) is dict else top
        self.nest(top, items)

    return made


Where = Callable[[MetadataUnpickler], tuple[Any, Iterable[Any]]]


def _filled(load: Loader, where: Where) -> Loader:
    """Items added to a container already made (APPEND, SETITEMS, ...)."""

    def filled(self: MetadataUnpickler) -> None:
        target, items = where(self)
        items = list(items)
        load(self)
        self.nest(self.stack[-1] if target is None else target, items)

    return filled


def _refused(name: str) -> Loader:
    return lambda self: self.refuse(name)


def _dispatch() -> dict[int, Loader]:
    """pickle's dispatch table with the calls checked, the containers counted and nested,
    and every other opcode that creates or calls refused."""
    table = dict(PICKLE)
    table[pickle.REDUCE[0]] = MetadataUnpickler.load_reduce_checked
    table[pickle.NEWOBJ[0]] = MetadataUnpickler.load_newobj_checked
    table[pickle.BUILD[0]] = MetadataUnpickler.load_build_checked
    for name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET"):
        op = getattr(pickle, name)[0]
        table[op] = _made(table[op])
    wheres: dict[str, Where] = {
        "APPEND": lambda self: (self.stack[-2], self.stack[-1:]),
        "SETITEM": lambda self: (self.stack[-3], self.stack[-2:]),
        "APPENDS": lambda self: (self.metastack[-1][-1], self.stack),
        "SETITEMS": lambda self: (self.metastack[-1][-1], self.stack),
        "ADDITEMS": lambda self: (self.metastack[-1][-1], self.stack),
        "REDUCE": lambda self: (None, self.stack[-1:]),
        "NEWOBJ": lambda self: (None, self.stack[-1:]),
        "BUILD": lambda self: (self.stack[-2], self.stack[-1:]),
    }
    for name, where in wheres.items():
        op = getattr(pickle, name)[0]
        table[op] = _filled(table[op], where)
    for name in ("INST", "OBJ", "NEWOBJ_EX", "PERSID", "BINPERSID"):
        table[getattr(pickle, name)[0]] = _refused(name)
    return table


MetadataUnpickler.dispatch = _dispatch()


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or f"a {type(obj).__name__}"


def _classes() -> tuple[type, ...]:
    return (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
        ChunkStorageMetadata,
        _StorageInfo,
    )


def _factories() -> tuple[object, ...]:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.serialization import _get_layout

    return (torch.Size, _MEM_FORMAT_ENCODING, _get_layout, PosixPath)
