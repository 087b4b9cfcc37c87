"""What a checkpoint saves of an executor, as a state dict that does not depend on D.

Every parameter and its AdamW state. FSDP saves each unit's flat parameter and moments as a
DTensor sharded on dim 0 over the unpadded length, which is exactly how its shards lie (HSDP:
on its mesh, replicated over the replicate dimension); a resume at another world size lets
DCP reshard them. DDP state is replicated, and DCP writes
it once. The item names are what layout.ITEM admits: `param.NAME`, `optim.NAME.exp_avg`,
`unit.UNIT.param` and the like.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def executor_state(ex) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments, keyed by name, in a form that does not depend on D."""
    if ex.units:
        return _unit_state(ex)
    state: dict[str, torch.Tensor] = {}
    opt = ex.optimizer
    for name, p in ex.params.items():
        state[f"param.{name}"] = p.detach()
        s = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{name}.{key}"] = s.get(key, torch.zeros_like(p))
    return state


def _unit_state(ex) -> dict[str, torch.Tensor]:
    """FSDP: each unit's shard of its flat parameter and moments, one DTensor each."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    state: dict[str, torch.Tensor] = {}
    mesh = _mesh(ex)
    # HSDP: sharded over the shard dimension, the same shard on each replica (DCP writes it
    # once and gives it to each on a resume)
    places = [Replicate(), Shard(0)] if ex.spec.hsdp else [Shard(0)]
    for u in ex.units.values():
        local = u.shard[: _kept(u)]
        parts = [p for group in u.optimizer_params() for p in group]
        m, v = (unit_moment(ex.optimizer, parts, key, local) for key in ("exp_avg", "exp_avg_sq"))
        for key, t in (("param", local), ("exp_avg", m), ("exp_avg_sq", v)):
            state[f"unit.{u.name}.{key}"] = DTensor.from_local(
                t.contiguous(),
                mesh,
                places,
                run_check=False,
                shape=torch.Size([u.numel]),
                stride=(1,),
            )
    return state


def unit_moment(opt, parts, key: str, local: torch.Tensor) -> torch.Tensor:
    """One AdamW moment of a unit's shard, flat: the optimizer's where it has one, zeros where
    it has none yet (before the first update, and the template a resume loads into).

    The zeros are made on the parameter's device and in its dtype: a resume on CUDA loads into
    this template and hands its slices to AdamW, which refuses moments on another device
    than their parameter (FSDP2's sharded state lives on the parameter's device too)."""
    if not parts:
        return local.new_zeros(0)
    return torch.cat(
        [opt.state.get(p, {}).get(key, torch.zeros_like(p).reshape(-1)) for p in parts]
    )


def load_executor_state(ex, state: dict[str, torch.Tensor], step: int) -> None:
    """Put a loaded state dict into the executor: its parameters, and after step 0 the
    optimizer's moments at `step` (before the first update AdamW has none)."""
    if ex.units:
        _load_units(ex, state, step)
        return
    opt = ex.optimizer
    with torch.no_grad():
        for name, p in ex.params.items():
            p.copy_(state[f"param.{name}"])
            if step > 0:
                opt.state[p] = _adam_state(
                    step,
                    state[f"optim.{name}.exp_avg"].clone(),
                    state[f"optim.{name}.exp_avg_sq"].clone(),
                )


def _load_units(ex, state: dict[str, torch.Tensor], step: int) -> None:
    """FSDP: each unit's shard, and its moments sliced back into its parameters' own."""
    opt = ex.optimizer
    for u in ex.units.values():
        u.shard[: _kept(u)].copy_(_local(state[f"unit.{u.name}.param"]))
        m = _local(state[f"unit.{u.name}.exp_avg"])
        v = _local(state[f"unit.{u.name}.exp_avg_sq"])
        off = 0
        for p in (p for group in u.optimizer_params() for p in group):
            k = p.numel()
            if step > 0:  # on the parameter's device, whatever DCP loaded into
                opt.state[p] = _adam_state(
                    step,
                    m[off : off + k].to(p.device, p.dtype, copy=True),
                    v[off : off + k].to(p.device, p.dtype, copy=True),
                )
            off += k


def unit_params(ex) -> dict[str, list[str]]:
    """Each FSDP unit's parameters in the order its flat parameter holds them (meta.json
    `unit_params`: what a reader needs to cut `unit.U.param` into tensors); {} for DDP. Every
    unit of the schedule: a DP rank holds each; a pipeline rank only its stages', so its
    executor says the schedule's (`schedule_units`, exec/pipeline_train.py)."""
    table = getattr(ex, "schedule_units", None)
    if table is not None:
        return table
    names = {id(p): n for n, p in ex.params.items()}
    return {u.name: [names[id(p)] for p, *_ in u.layout] for u in ex.units.values()}


def unit_sizes(ex) -> dict[str, int]:
    """Each unit of `unit_params` and its elements (meta.json `units`)."""
    model = ex.spec.model
    return {u: sum(model.param(n).numel for n in names) for u, names in unit_params(ex).items()}


def load_parameters(ex, params: dict[str, torch.Tensor]) -> None:
    """Full parameters by name (`--init hf:DIR`) into the executor before step 0: every rank
    is given them all, as every rank builds the whole model before sharding it, and keeps
    its part (an FSDP unit: its shard of the flat parameter, in its layout's order)."""
    with torch.no_grad():
        if not ex.units:
            for name, p in ex.params.items():
                p.copy_(params[name])
            return
        for u, names in unit_params(ex).items():
            if u not in ex.units:
                continue  # another pipeline rank's
            unit = ex.units[u]
            flat = torch.cat([params[n].reshape(-1) for n in names])
            lo = unit.rank * unit.shard_len
            unit.shard[: _kept(unit)].copy_(flat[lo : lo + _kept(unit)])


def _adam_state(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict[str, Any]:
    """AdamW's state of one parameter after `step` updates (it keeps the step as a tensor)."""
    return {"step": torch.tensor(float(step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a unit's item: executor_state made it a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _kept(u) -> int:
    """The unpadded part of this rank's shard (torch.chunk's split: the last may be short)."""
    return max(0, min(u.shard_len, u.numel - u.rank * u.shard_len))


def _mesh(ex):
    """The device mesh a unit's DTensors lie on: the job's ranks, under HSDP its mesh
    replicate x shard in rank order (made once a run: making it is collective), or the one
    the executor says (a pipeline stage's shard group: exec/pipeline_train.py)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if getattr(ex, "checkpoint_mesh", None) is not None:  # made already (a pipeline stage's)
        return ex.checkpoint_mesh
    if ex.spec.hsdp:
        m = ex.spec.mesh
        ex.checkpoint_mesh = init_device_mesh(
            ex.device.type, (m.replicate, m.shard), mesh_dim_names=("replicate", "shard")
        )
        return ex.checkpoint_mesh
    group = ex.comm.group or dist.distributed_c10d._get_default_group()
    return DeviceMesh.from_group(group, ex.device.type)
