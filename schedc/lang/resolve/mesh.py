"""The mesh: `mesh R x S`, the world as replicate x shard. R x S must be the world, and only
FSDP shards (DDP's mesh is `world x 1`); FSDP with R > 1 is HSDP."""

from __future__ import annotations

from schedc.ir.spec import DDPSpec, FSDPSpec, Mesh
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.values import LIMITS, int_of
from schedc.lang.syntax import MeshDecl


def resolve_mesh(
    cx: Context, world: int | None, strategy: DDPSpec | FSDPSpec | None
) -> Mesh | None:
    """The declared mesh; None where none is declared (the strategy's flat one) or it is
    wrong."""
    m = cx.single(MeshDecl, "mesh", "the mesh")
    if m is None:
        return None
    hi = LIMITS["world"][1]
    r = int_of(cx.diag, m.replicate, "mesh replicate size", 1, hi)
    s = int_of(cx.diag, m.shard, "mesh shard size", 1, hi)
    if r is None or s is None or world is None:
        return None
    if r * s != world:
        cx.err(
            "mesh-size",
            f"mesh {r} x {s} is {r * s} rank{'s' * (r * s != 1)}, but the world is {world}",
            m.span,
            hint=_mesh_hint(world),
        )
        return None
    if isinstance(strategy, DDPSpec) and s > 1:
        cx.err(
            "mesh-ddp",
            f"a ddp schedule shards nothing: its mesh is {world} x 1, not {r} x {s}",
            m.span,
            hint=f"write `mesh {world} x 1`, or use an fsdp block to shard over {s} ranks",
        )
        return None
    return Mesh(r, s)


def _mesh_hint(world: int) -> str:
    shapes = [f"{world // s} x {s}" for s in range(1, world + 1) if world % s == 0][:6]
    return f"replicate x shard must multiply to the world; for world {world}: {', '.join(shapes)}"
