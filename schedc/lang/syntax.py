"""The AST built from the Lark tree, in a separate step: `to_ast(tree, source)`. The nodes
are nodes.py's (and are importable from here, as every pass imports them).
"""

from __future__ import annotations

__all__ = [
    "Name",
    "Num",
    "Str",
    "Switch",
    "Size",
    "Field",
    "Model",
    "Setting",
    "Batch",
    "MeshDecl",
    "Memory",
    "Data",
    "Evaluation",
    "Optimizer",
    "Precision",
    "Ref",
    "BucketDecl",
    "BucketCap",
    "Toggle",
    "UnitDecl",
    "Prefetch",
    "LossChunk",
    "Recompute",
    "OtherSetting",
    "DDP",
    "FSDP",
    "StreamDecl",
    "OpText",
    "ProgramLine",
    "Program",
    "StageDecl",
    "PipeSetting",
    "Pipeline",
    "Schedule",
    "Value",
    "BlockStmt",
    "Stmt",
    "to_ast",
]

from collections.abc import Callable

from lark import Token, Tree, v_args
from lark.tree import Meta

from schedc.ir.source import Source, Span
from schedc.lang.nodes import (
    DDP,
    FSDP,
    Batch,
    BlockStmt,
    BucketCap,
    BucketDecl,
    Data,
    Evaluation,
    Field,
    LossChunk,
    Memory,
    MeshDecl,
    Model,
    Name,
    Num,
    OpText,
    Optimizer,
    OtherSetting,
    Pipeline,
    PipeSetting,
    Precision,
    Prefetch,
    Program,
    ProgramLine,
    Recompute,
    Ref,
    Schedule,
    Setting,
    Size,
    StageDecl,
    Stmt,
    Str,
    StreamDecl,
    Switch,
    Toggle,
    UnitDecl,
    Value,
)
from schedc.lang.syntax_pipeline import PipelineBuilders

# -- tree -> AST --------------------------------------------------------------------------------


def to_ast(tree: Tree, source: Source) -> Schedule:
    return Schedule(tuple(_ToAST(source).transform(tree).children), source)


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
