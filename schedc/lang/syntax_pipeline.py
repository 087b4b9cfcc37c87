"""The AST of a `pipeline { ... }` block, and the builders that make it from the Lark tree
(mixed into syntax._ToAST, which is already at the size a module should stay under)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lark import Transformer, v_args

if TYPE_CHECKING:
    from schedc.ir.source import Span
    from schedc.lang.syntax import Name, Num, OtherSetting, Ref


@dataclass(frozen=True)
class StageDecl:
    """`stage s0 = embed, h.0 .. h.1`: a named run of layers that one rank computes."""

    name: Name
    refs: tuple[Ref, ...]
    span: Span


@dataclass(frozen=True)
class PipeSetting:
    """`degree 4`, `schedule 1f1b`, `placement loop`, `microbatches 8`: a key and its value."""

    key: str
    value: Name | Num
    span: Span


@dataclass(frozen=True)
class Pipeline:
    stmts: tuple[StageDecl | PipeSetting | OtherSetting, ...]  # Other: a key it lacks
    span: Span


def _setting(key: str):
    def build(self, meta, c):
        return PipeSetting(key, c[0], self._span(meta))

    return build


@v_args(meta=True)
class PipelineBuilders(Transformer):
    """The pipeline rules' builders; `_span` is syntax._ToAST's."""

    def stage(self, meta, c):
        return StageDecl(c[0], c[1], self._span(meta))

    def pipeline(self, meta, c):
        return Pipeline(tuple(c), self._span(meta))

    degree = _setting("degree")
    pp_schedule = _setting("schedule")
    placement = _setting("placement")
    microbatches = _setting("microbatches")
