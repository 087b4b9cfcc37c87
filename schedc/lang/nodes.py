"""The AST's nodes: frozen dataclasses with source spans (syntax.py builds them from the Lark
tree in a separate step).

The AST records what was written and where; it judges nothing. Numbers stay as written
(a Num keeps its text) so that the resolve pass can say "world must be a whole number
>= 1" pointing at the exact characters.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.source import Source, Span


def _is_int_text(text: str) -> bool:
    t = text.lstrip("+-")
    return t.isdigit()


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


# -- pipeline stages (#31) ---------------------------------------------------------------------


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
class PipeItem:
    """`F[s0]@mb0`, or transfers issued together: `SEND_F[s0]@mb1+RECV_B[s0]@mb0`."""

    actions: tuple[OpText, ...]  # as written; resolve/pipeline_programs.py reads them
    span: Span


@dataclass(frozen=True)
class PipeProgram:
    """`program on rank 0 { ... }` in a pipeline block: a pipeline rank's items in order."""

    rank: Num
    items: tuple[PipeItem, ...]
    span: Span


@dataclass(frozen=True)
class Pipeline:
    stmts: tuple[StageDecl | PipeSetting | PipeProgram | OtherSetting, ...]  # Other: unknown
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
