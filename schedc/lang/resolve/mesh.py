"""The mesh: `mesh R x S`, the world as replicate x shard. R x S must be the world, and only
FSDP shards (DDP's mesh is `world x 1`); FSDP with R > 1 is HSDP.

In a pipeline file the mesh is that of each stage's dp = world / degree replicas (torchtitan's
["pp", "dp_replicate", "dp_shard"], pp outermost): R x S must be dp, and it takes an fsdp
block, which shards each stage's units over S ranks and all-reduces their gradient shards
over R (a pipeline without one replicates each stage over its dp ranks, [mesh-ddp])."""

from __future__ import annotations

from schedc.ir.spec import DDPSpec, FSDPSpec, Mesh, PipelineSpec
from schedc.lang.diagnostics import Note
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.values import LIMITS, int_of
from schedc.lang.syntax import MeshDecl


def resolve_mesh(
    cx: Context,
    world: int | None,
    strategy: DDPSpec | FSDPSpec | None,
    pipe: PipelineSpec | None = None,
) -> Mesh | None:
    """The declared mesh; None where none is declared (the strategy's flat one) or it is
    wrong. In a pipeline file (`pipe`, None after an error in its block) it is the stages'
    dp replicas' (`resolve_stage_mesh`)."""
    if "pipeline" in cx.seen:
        dp = None if pipe is None or world is None else world // pipe.degree
        return resolve_stage_mesh(cx, pipe, dp)
    m = _declared(cx)
    if m is None:
        return None
    decl, r, s = m
    if world is None or not _covers(cx, decl, r, s, world, f"the world is {world}", ()):
        return None
    if isinstance(strategy, DDPSpec) and s > 1:
        cx.err(
            "mesh-ddp",
            f"a ddp schedule shards nothing: its mesh is {world} x 1, not {r} x {s}",
            decl.span,
            hint=f"write `mesh {world} x 1`, or use an fsdp block to shard over {s} ranks",
        )
        return None
    return Mesh(r, s)


def resolve_stage_mesh(cx: Context, pipe: PipelineSpec | None, dp: int | None) -> Mesh | None:
    """A pipeline file's mesh: each stage's dp replicas as replicate x shard (R x S = dp,
    [mesh-size]), which only an fsdp block shards ([mesh-ddp]); None where none is declared
    (FSDP per stage then shards over all dp replicas) or it is wrong."""
    m = _declared(cx)
    if m is None or pipe is None or dp is None:
        return None
    decl, r, s = m
    head = Note("the pipeline is declared here", pipe.span)
    if not pipe.units:
        cx.err(
            "mesh-ddp",
            f"a pipeline without an fsdp block replicates each stage over its {dp} dp "
            f"ranks and shards nothing: it takes no mesh {r} x {s}",
            decl.span,
            hint=f"add `fsdp {{ }}` to shard each stage's units over {s} ranks and all-reduce "
            f"their gradient shards over {r}, or drop the mesh",
            notes=(head,),
        )
        return None
    degree = pipe.degree
    why = f"a stage's replicas are dp = world {dp * degree} / degree {degree} = {dp}"
    if not _covers(cx, decl, r, s, dp, why, (head,), "dp"):
        return None
    return Mesh(r, s)


def _declared(cx: Context) -> tuple[MeshDecl, int, int] | None:
    """The mesh statement and its two sizes; None without one, or with a size out of range."""
    m = cx.single(MeshDecl, "mesh", "the mesh")
    if m is None:
        return None
    hi = LIMITS["world"][1]
    r = int_of(cx.diag, m.replicate, "mesh replicate size", 1, hi)
    s = int_of(cx.diag, m.shard, "mesh shard size", 1, hi)
    return None if r is None or s is None else (m, r, s)


def _covers(
    cx: Context,
    decl: MeshDecl,
    r: int,
    s: int,
    ranks: int,
    why: str,
    notes: tuple[Note, ...],
    what: str = "the world",
) -> bool:
    """R x S is `ranks` (the world, or a pipeline stage's dp replicas); else [mesh-size]."""
    if r * s == ranks:
        return True
    cx.err(
        "mesh-size",
        f"mesh {r} x {s} is {r * s} rank{'s' * (r * s != 1)}, but {why}",
        decl.span,
        hint=_mesh_hint(ranks, what),
        notes=notes,
    )
    return False


def _mesh_hint(ranks: int, what: str = "the world") -> str:
    shapes = [f"{ranks // s} x {s}" for s in range(1, ranks + 1) if ranks % s == 0][:6]
    word = what.removeprefix("the ")
    return f"replicate x shard must multiply to {what}; for {word} {ranks}: {', '.join(shapes)}"
