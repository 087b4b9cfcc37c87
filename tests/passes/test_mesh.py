"""HSDP: `mesh R x S` in the language, the mesh's groups, the graph's replicate all-reduce,
the memory ledger and the program dump that parses back."""

from __future__ import annotations

import pytest

from schedc.compiler import compile_text
from schedc.ir.op import Kind, Op
from schedc.ir.spec import REPLICATE, SHARD, Mesh
from schedc.passes.dump import dump_program
from schedc.passes.memory import predict, traffic

FSDP = """\
model tiny world {world}{mesh}
batch {seqs} x 64 micro 2
fsdp {{
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = h.1 .. h.2
  unit u3 = h.3, head
  no_sync {no_sync}
}}
"""


def hsdp(world=4, mesh="2 x 2", seqs=16, no_sync="off"):
    m = f"\nmesh {mesh}" if mesh else ""
    return compile_text(FSDP.format(world=world, mesh=m, seqs=seqs, no_sync=no_sync))


def test_mesh_groups_follow_torchrun_rank_order():
    m = Mesh(2, 4)  # two nodes of four
    assert m.groups(SHARD) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert m.groups(REPLICATE) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert m.members(6, SHARD) == (4, 5, 6, 7) and m.index(6, SHARD) == 2
    assert m.members(6, REPLICATE) == (2, 6) and m.index(6, REPLICATE) == 1
    # every rank is in exactly one group of each dimension
    for dim in (SHARD, REPLICATE):
        assert sorted(r for g in m.groups(dim) for r in g) == list(range(8))


def test_flat_schedules_have_one_dimension():
    flat = hsdp(mesh=None).spec
    assert flat.mesh == Mesh(1, 4) and not flat.hsdp and flat.dims() == (SHARD,)
    ddp = compile_text("model nano world 4 batch 8 x 32 micro 2\nddp { bucket_cap 1 MiB }")
    assert ddp.spec.mesh == Mesh(4, 1) and ddp.spec.dims() == (REPLICATE,)
    same = compile_text(
        "model nano world 4 mesh 4 x 1 batch 8 x 32 micro 2\nddp { bucket_cap 1 MiB }"
    )
    assert same.plan(0).instrs == ddp.plan(0).instrs  # DDP's mesh changes nothing


@pytest.mark.parametrize("no_sync", ["off", "on"])
def test_each_reduce_scatter_is_followed_by_its_replicate_allreduce(no_sync):
    c = hsdp(no_sync=no_sync)
    comm = c.plan(0).collectives()
    rs = [op for op in comm if op.kind is Kind.REDUCESCATTER]
    ar = [op for op in comm if op.kind is Kind.ALLREDUCE]
    assert rs and [(o.target, o.mb) for o in rs] == [(o.target, o.mb) for o in ar]
    for op in ar:  # the all-reduce reads the reduce-scatter's output shard
        assert c.graph().g.has_edge(Op(Kind.REDUCESCATTER, op.target, op.mb), op)
        assert c.spec.dim_of(op) == REPLICATE
    last = c.spec.accum - 1
    step_needs = set(c.graph().g.predecessors(Op(Kind.STEP)))
    assert {Op(Kind.ALLREDUCE, u, last) for u in ("tied", "u1", "u2", "u3")} <= step_needs
    flat = hsdp(mesh=None, no_sync=no_sync).plan(0).collectives()
    assert [op for op in comm if op.kind is not Kind.ALLREDUCE] == flat


def test_program_dump_parses_back():
    c = hsdp()
    text = dump_program(c.graph())
    assert "allreduce[u2]@mb1" in text
    again = compile_text(FSDP.format(world=4, mesh="\nmesh 2 x 2", seqs=16, no_sync="off") + text)
    assert again.plan(0).instrs == c.plan(0).instrs


def test_written_program_without_the_replicate_allreduce_is_rejected():
    c = hsdp()
    text = dump_program(c.graph()).replace("  allreduce[u2]@mb1\n", "")
    with pytest.raises(Exception) as e:
        compile_text(FSDP.format(world=4, mesh="\nmesh 2 x 2", seqs=16, no_sync="off") + text)
    assert "unit 'u2' is never all-reduced over the replicate dimension in micro-step 1" in str(
        e.value
    )


def test_allreduce_of_a_unit_needs_a_replicated_mesh():
    c = hsdp(mesh="1 x 4")
    text = dump_program(c.graph()).replace(
        "reducescatter[u1]@mb1", "reducescatter[u1]@mb1 allreduce[u1]@mb1"
    )
    with pytest.raises(Exception) as e:
        compile_text(FSDP.format(world=4, mesh="\nmesh 1 x 4", seqs=16, no_sync="off") + text)
    assert "allreduce[u1]@mb1 has no place" in str(e.value)


def test_sharded_states_are_divided_by_the_shard_size():
    flat4 = predict(hsdp(mesh=None).spec, hsdp(mesh=None).plan(0))
    flat2 = compile_text(FSDP.format(world=2, mesh="", seqs=8, no_sync="off"))
    two = predict(flat2.spec, flat2.plan(0))
    h = hsdp()
    mesh = predict(h.spec, h.plan(0))
    assert mesh.states == two.states > flat4.states  # 2 x 2 holds what world 2 holds


def test_traffic_per_dimension():
    h = hsdp()
    t = traffic(h.spec, h.plan(0))
    assert set(t) == {SHARD, REPLICATE}
    assert set(t[SHARD]) == {"allgather", "reducescatter"} and set(t[REPLICATE]) == {"allreduce"}
    # each all-reduce moves the shard of what its reduce-scatter moved: S = 2
    assert t[REPLICATE]["allreduce"] * 2 == t[SHARD]["reducescatter"]


def _comm_program(c, rank: int, swap: tuple[str, str]) -> str:
    """The comm program written for one rank, with two of its lines swapped."""
    text = dump_program(c.graph())
    comm = text[text.index("program comm {") :]
    lines = comm.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith(swap[0]))
    j = next(k for k, ln in enumerate(lines) if ln.strip().startswith(swap[1]))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines).replace("program comm {", f"program comm on rank {rank} {{", 1) + "\n"


def _with_programs(*programs: str):
    return compile_text(
        FSDP.format(world=4, mesh="\nmesh 2 x 2", seqs=8, no_sync="off") + "".join(programs)
    )


def test_spmd_is_per_group():
    c = _with_programs()  # k = 1
    swap = ("allreduce[u2]@mb0", "reducescatter[tied]@mb0")
    # rank 1 and rank 3 form a replicate group: both reorder their replicate all-reduce
    # against the shard group's reduce-scatter; each group still agrees, and nothing hangs
    ok = _with_programs(_comm_program(c, 1, swap), _comm_program(c, 3, swap))
    assert ok.plan(1).collectives() != ok.plan(0).collectives()
    # rank 1 alone: its replicate group {1, 3} disagrees
    with pytest.raises(Exception) as e:
        _with_programs(_comm_program(c, 1, ("allreduce[u2]@mb0", "allreduce[tied]@mb0")))
    msg = str(e.value)
    assert "[spmd]" in msg and "over the replicate dimension" in msg
    assert "the other ranks of its replicate group issue allreduce[u2]@mb0" in msg
