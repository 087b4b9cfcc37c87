"""torch `_Action` text (`0F0`, `0SEND_F0`, `1RECV_F0`) as schedc pipeline programs, for tests
and bench scripts only: torch's data-parallel actions (UNSHARD, RESHARD, REDUCE_GRAD) carry
no pipeline meaning here and are dropped; every torch SEND/RECV is its own item, as torch's
runtime issues each as its own isend/irecv."""

from __future__ import annotations

import re

from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.pipeline import Programs

_TORCH = re.compile(r"(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)")
DP_ONLY = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}


def from_torch(text: str) -> Op | None:
    """One torch action; None for a data-parallel one."""
    m = _TORCH.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a torch _Action: {text!r}")
    if m.group(2) in DP_ONLY:
        return None
    return stage_op(Kind(m.group(2)), int(m.group(1)), int(m.group(3)))


def programs_from_torch(lists: dict[int, list[str]] | list[str]) -> Programs:
    """Per-rank lists of torch action text (a list of strings, one per rank, words split)."""
    if isinstance(lists, list):
        lists = {r: text.split() for r, text in enumerate(lists)}
    out: Programs = {}
    for r, words in lists.items():
        acts = [from_torch(str(w)) for w in words if w is not None and str(w) != "None"]
        out[r] = [(a,) for a in acts if a is not None]
    return out
