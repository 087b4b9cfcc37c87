"""The builders of a `pipeline { ... }` block's AST (nodes.py) from the Lark tree, mixed into
syntax._ToAST."""

from __future__ import annotations

from lark import Transformer, v_args

from schedc.lang.nodes import PipeItem, Pipeline, PipeProgram, PipeSetting, StageDecl


def _setting(key: str):
    def build(self, meta, c):
        return PipeSetting(key, c[0], self._span(meta))

    return build


@v_args(meta=True)
class PipelineBuilders(Transformer):
    """The pipeline rules' builders; `_span` is syntax._ToAST's."""

    def stage(self, meta, c):
        return StageDecl(c[0], c[1], self._span(meta))

    def pp_item(self, meta, c):
        return PipeItem(tuple(c), self._span(meta))

    def pp_program(self, meta, c):
        return PipeProgram(c[0], tuple(c[1:]), self._span(meta))

    def pipeline(self, meta, c):
        return Pipeline(tuple(c), self._span(meta))

    degree = _setting("degree")
    pp_schedule = _setting("schedule")
    placement = _setting("placement")
    microbatches = _setting("microbatches")
