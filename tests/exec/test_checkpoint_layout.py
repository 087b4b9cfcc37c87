"""What a checkpoint says of its FSDP units: each unit's parameters in its flat parameter's
order (meta.json `unit_params`), which `schedc export` cuts the units by and a resume holds
the schedule's units to."""

from __future__ import annotations

import pytest

from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.layout import CheckpointError
from tests.world1 import executor

SWAPPED = """model nano {{ block = 2 }}
world 1
batch 8 x 2
micro 2
fsdp {{
  unit tied = wte.weight keep
  unit {} = wpe.weight, h.0
  unit {} = h.1, head
}}
"""


def test_a_resume_into_units_of_the_same_sizes_holding_other_parameters_is_refused(
    world1, tmp_path
):
    """wpe (2 x 32) is as large as ln_f's weight and bias, so units x and y are as large in
    both schedules but hold other parameters: once loaded silently, scrambled."""
    ex = executor(SWAPPED.format("x", "y"))
    store.save(ex, tmp_path / "ck")
    other = executor(SWAPPED.format("y", "x"))
    assert {u.name: u.numel for u in other.units.values()} == {
        u.name: u.numel for u in ex.units.values()
    }
    with pytest.raises(CheckpointError, match="its FSDP units hold other parameters"):
        store.load(other, tmp_path / "ck")
    ex.close()
    other.close()
