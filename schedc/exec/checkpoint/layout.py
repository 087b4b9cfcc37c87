"""How a checkpoint lies on disk, and the bounds a reader holds it to.

    DIR/step_00000040/      one checkpoint: torch.distributed.checkpoint files + meta.json
                            (+ meta.json.hmac when saved with --checkpoint-key)
    DIR/latest              the name of the newest complete checkpoint

Every name a checkpoint may contain is one of the patterns below, and every file has a
size limit a reader checks before reading it (a sparse file costs nothing to make).
"""

from __future__ import annotations

import re

import torch

from schedc.errors import UserError

FORMAT = 2  # meta.json's "format" (2 added the token stream, the LR horizon, and the
# parameters of each FSDP unit in flat order)
FORMATS = (1, 2)  # what a resume reads: a format-1 checkpoint has none of those to compare
HMAC_FILE = "meta.json.hmac"
MAX_META_BYTES = 32 << 20  # meta.json: 7 KB at world 1 (6.7 KB of it a rank's RNG state)
MAX_METADATA_BYTES = 64 << 20  # DCP's .metadata: 38 KB for the tiny model's 157 tensors
MAX_FILES, MAX_WORLD, MAX_UNITS = 4096, 4096, 4096
RECORD_SLACK = 64 << 10  # a stored chunk's record: its bytes plus torch.save's (1,577 measured)
STEP_DIR = re.compile(r"step_[0-9]{8,12}")
DCP_FILE = re.compile(r"\.metadata|__[0-9]{1,6}_[0-9]{1,6}\.distcp")  # what DCP writes
ITEM = re.compile(r"(param|optim|unit)\.[A-Za-z0-9_.]{1,200}")  # what executor_state writes
HEX64 = re.compile(r"[0-9a-f]{64}")
HEX16 = re.compile(r"[0-9a-f]{16}")  # a data fingerprint (model/data.py)
STRATEGIES = ("single", "ddp", "fsdp")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, altered or for another schedule."""


def step_dir(step: int) -> str:
    """The directory name of the checkpoint after `step` steps."""
    return f"step_{step:08d}"
