"""The AST: frozen dataclasses with source spans, built from the Lark tree in a separate step.

The AST records what was written and where; it judges nothing. Numbers stay as written
(a Num keeps its text) so that the resolve pass can say "world must be a whole number
>= 1" pointing at the exact characters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lark import Token, Tree, v_args
from lark.tree import Meta

from schedc.ir.source import Source, Span
from schedc.lang.syntax_pipeline import Pipeline, PipelineBuilders

# -- leaves -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    text: str
    span: Span


@dataclass(frozen=True)
class Num:
    text: str
    span: Span

    @property
    def value(self) -> float:
        return float(self.text)

    @property
    def is_int(self) -> bool:
        return _is_int_text(self.text)


@dataclass(frozen=True)
class Str:
    text: str  # without the quotes
    span: Span


@dataclass(frozen=True)
class Switch:
    on: bool
    span: Span


@dataclass(frozen=True)
class Size:
    number: Num
    unit: str  # "" when no unit was written (bytes)
    span: Span


Value = Num | Name | Str | Switch

# -- statements ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    key: Name
    values: tuple[Value, ...]
    span: Span


@dataclass(frozen=True)
class Model:
    name: Name | None
    fields: tuple[Field, ...]
    span: Span


@dataclass(frozen=True)
class Setting:
    """`world 8`, `micro 16`, `accumulate 4`, `steps 10`, `seed 1`: a keyword and a number."""

    key: str
    value: Num
    span: Span


@dataclass(frozen=True)
class Batch:
    sequences: Num
    tokens: Num
    span: Span


@dataclass(frozen=True)
class MeshDecl:
    """`mesh 2 x 4`: the world as replicate x shard."""

    replicate: Num
    shard: Num
    span: Span


@dataclass(frozen=True)
class Memory:
    size: Size
    span: Span


@dataclass(frozen=True)
class Data:
    kind: str  # "auto", "text" or "tokens"
    source: Name | Str
    span: Span
    also: tuple[Str, ...] = ()  # `data "a.npy", "b.npy"`: the sources after the first


@dataclass(frozen=True)
class Evaluation:
    fields: tuple[Field, ...]
    span: Span


@dataclass(frozen=True)
class Optimizer:
    name: Name
    fields: tuple[Field, ...]
    span: Span


@dataclass(frozen=True)
class Precision:
    """`precision bf16 { reduce = fp32 }`: a named policy, optionally with overrides."""

    name: Name | None
    fields: tuple[Field, ...]
    span: Span


@dataclass(frozen=True)
class Ref:
    """One layer or parameter (`h.3`, `embed`, `wte.weight`), or a range `h.0 .. h.5`."""

    first: Name
    last: Name | None
    span: Span


@dataclass(frozen=True)
class BucketDecl:
    name: Name
    refs: tuple[Ref, ...]
    span: Span


@dataclass(frozen=True)
class BucketCap:
    size: Size
    first: Size | None
    span: Span


@dataclass(frozen=True)
class Toggle:
    """`overlap on`, `no_sync off`, `reshard_after_forward on`."""

    key: str
    value: Switch
    span: Span


@dataclass(frozen=True)
class UnitDecl:
    name: Name
    refs: tuple[Ref, ...]
    keep: bool
    span: Span


@dataclass(frozen=True)
class Prefetch:
    direction: str  # "forward" | "backward"
    depth: Num
    span: Span


@dataclass(frozen=True)
class LossChunk:
    """`loss chunk 1024`: the head's logits and cross-entropy 1024 tokens at a time."""

    tokens: Num
    span: Span


@dataclass(frozen=True)
class Recompute:
    """`recompute h.0 .. h.11` (layers), or inside fsdp `recompute u1, u3` (units)."""

    refs: tuple[Ref, ...]
    span: Span


@dataclass(frozen=True)
class OtherSetting:
    """A statement in a ddp or fsdp block that begins with a name no statement has (`overlpa
    on`, `bucket_cap_mb = 25`): recorded as written, for the resolver to name."""

    key: Name
    span: Span


BlockStmt = BucketDecl | BucketCap | Toggle | UnitDecl | Prefetch | Recompute | OtherSetting


@dataclass(frozen=True)
class DDP:
    stmts: tuple[BlockStmt, ...]  # either block's statements parse in both; resolve judges
    span: Span


@dataclass(frozen=True)
class FSDP:
    stmts: tuple[BlockStmt, ...]
    span: Span


@dataclass(frozen=True)
class StreamDecl:
    """`stream allreduce = compute`: every op of a kind runs on the named stream."""

    kind: Name
    stream: Name
    span: Span


@dataclass(frozen=True)
class OpText:
    text: str
    span: Span


@dataclass(frozen=True)
class ProgramLine:
    op: OpText
    after: tuple[OpText, ...]
    span: Span


@dataclass(frozen=True)
class Program:
    """A stream's ops in the order written, each waiting only on what its `after` names."""

    stream: Name
    rank: Num | None
    instrs: tuple[ProgramLine, ...]
    span: Span


Stmt = (
    Model
    | Setting
    | Batch
    | MeshDecl
    | Memory
    | Data
    | Optimizer
    | Evaluation
    | Precision
    | Toggle
    | LossChunk
    | Recompute
    | DDP
    | FSDP
    | StreamDecl
    | Program
    | Pipeline
)


@dataclass(frozen=True)
class Schedule:
    stmts: tuple[Stmt, ...]
    source: Source


# -- tree -> AST --------------------------------------------------------------------------------


def to_ast(tree: Tree, source: Source) -> Schedule:
    return Schedule(tuple(_ToAST(source).transform(tree).children), source)


def _is_int_text(text: str) -> bool:
    t = text.lstrip("+-")
    return t.isdigit()


def _setting(key: str) -> Callable[[_ToAST, Meta, list], Setting]:
    """The rule of a `key N` statement (`world 8`): one builder for the five of them."""

    def build(self: _ToAST, meta: Meta, c: list) -> Setting:
        return Setting(key, c[0], self._span(meta))

    return build


def _toggle(key: str) -> Callable[[_ToAST, Meta, list], Toggle]:
    """The rule of a `key on|off` statement (`overlap on`)."""

    def build(self: _ToAST, meta: Meta, c: list) -> Toggle:
        return Toggle(key, c[0], self._span(meta))

    return build


@v_args(meta=True)
class _ToAST(PipelineBuilders):
    """Each method builds one AST class from the rule of the same (alias) name."""

    def __init__(self, source: Source):
        super().__init__()
        self.src = source

    def _span(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return self.src.span(0, 0)
        return self.src.span(meta.start_pos, meta.end_pos)

    def _tok(self, tok: Token) -> Span:
        # a token of the tree comes from the lexer, which places both its ends
        assert tok.start_pos is not None and tok.end_pos is not None
        return self.src.span(tok.start_pos, tok.end_pos)

    def __default_token__(self, tok: Token):
        span = self._tok(tok)
        if tok.type in ("NAME", "SCHEDULE_NAME"):
            return Name(str(tok), span)
        if tok.type == "NUMBER":
            return Num(str(tok), span)
        if tok.type == "STRING":
            return Str(str(tok)[1:-1], span)
        if tok.type == "OP":
            return OpText(str(tok), span)
        return tok

    # values
    def number(self, meta, c):
        return c[0]

    def word(self, meta, c):
        return c[0]

    def string(self, meta, c):
        return c[0]

    def on(self, meta, c):
        return Switch(True, self._span(meta))

    def off(self, meta, c):
        return Switch(False, self._span(meta))

    def size(self, meta, c):
        unit = str(c[1]) if len(c) > 1 else ""
        return Size(c[0], unit, self._span(meta))

    def field(self, meta, c):
        return Field(c[0], tuple(c[1:]), self._span(meta))

    def fields(self, meta, c):
        return tuple(c)

    # the run
    def model(self, meta, c):
        name = next((x for x in c if isinstance(x, Name)), None)
        fields = next((x for x in c if isinstance(x, tuple)), ())
        return Model(name, fields, self._span(meta))

    world = _setting("world")
    micro = _setting("micro")
    accumulate = _setting("accumulate")
    steps = _setting("steps")
    seed = _setting("seed")

    def batch(self, meta, c):
        return Batch(c[0], c[1], self._span(meta))

    def mesh(self, meta, c):
        return MeshDecl(c[0], c[1], self._span(meta))

    def memory(self, meta, c):
        return Memory(c[0], self._span(meta))

    def text_kind(self, meta, c):
        return "text"

    def tokens_kind(self, meta, c):
        return "tokens"

    def data(self, meta, c):
        kind = c[0] if isinstance(c[0], str) and not isinstance(c[0], Token) else "auto"
        sources = [x for x in c if isinstance(x, (Name, Str))]
        return Data(kind, sources[0], self._span(meta), tuple(sources[1:]))

    def evaluation(self, meta, c):
        return Evaluation(c[0] if c else (), self._span(meta))

    def optimizer(self, meta, c):
        return Optimizer(c[0], c[1] if len(c) > 1 else (), self._span(meta))

    def precision(self, meta, c):
        name = next((x for x in c if isinstance(x, Name)), None)
        fields = next((x for x in c if isinstance(x, tuple)), ())
        return Precision(name, fields, self._span(meta))

    # DDP / FSDP
    def ref_one(self, meta, c):
        return Ref(c[0], None, self._span(meta))

    def ref_range(self, meta, c):
        return Ref(c[0], c[1], self._span(meta))

    def refs(self, meta, c):
        return tuple(c)

    def bucket(self, meta, c):
        return BucketDecl(c[0], c[1], self._span(meta))

    def bucket_cap(self, meta, c):
        return BucketCap(c[0], c[1] if len(c) > 1 else None, self._span(meta))

    tf32 = _toggle("tf32")
    compile = _toggle("compile")
    overlap = _toggle("overlap")
    no_sync = _toggle("no_sync")
    reshard = _toggle("reshard_after_forward")

    def ddp(self, meta, c):
        return DDP(tuple(c), self._span(meta))

    def keep(self, meta, c):
        return True

    def unit(self, meta, c):
        return UnitDecl(c[0], c[1], len(c) > 2, self._span(meta))

    def forward(self, meta, c):
        return "forward"

    def backward(self, meta, c):
        return "backward"

    def prefetch(self, meta, c):
        return Prefetch(c[0], c[1], self._span(meta))

    def fsdp(self, meta, c):
        return FSDP(tuple(c), self._span(meta))

    def other_setting(self, meta, c):
        return OtherSetting(c[0], self._span(meta))

    def recompute(self, meta, c):
        return Recompute(c[0], self._span(meta))

    def loss(self, meta, c):
        return LossChunk(c[-1], self._span(meta))

    # streams and programs
    def stream(self, meta, c):
        return StreamDecl(c[0], c[1], self._span(meta))

    def on_rank(self, meta, c):
        return c[0]

    def after(self, meta, c):
        return tuple(c)

    def instr(self, meta, c):
        return ProgramLine(c[0], c[1] if len(c) > 1 else (), self._span(meta))

    def program(self, meta, c):
        rank = next((x for x in c[1:] if isinstance(x, Num)), None)
        instrs = tuple(x for x in c[1:] if isinstance(x, ProgramLine))
        return Program(c[0], rank, instrs, self._span(meta))
