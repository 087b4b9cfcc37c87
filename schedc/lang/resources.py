"""Files that ship with schedc: the grammar and the bundled schedules.

Both live at the top of the repository (grammar/, schedules/); an installed wheel carries
copies inside the package (schedc/grammar/, schedc/schedules/). A checkout's own copy wins,
so an editable install sees edits at once.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_SCHEDULE = "tiny_ddp_overlap.sched"  # what `schedc run` trains when given no file


def shipped_dir(name: str) -> Path:
    """The top-level folder `name` of a checkout, or its copy inside the installed package."""
    here = Path(__file__).resolve().parents[1]  # the schedc package
    for candidate in (here.parent / name, here / name):
        if candidate.is_dir():
            return candidate
    packaged = resources.files("schedc") / name
    if packaged.is_dir():
        return Path(str(packaged))
    raise FileNotFoundError(f"schedc ships a {name}/ folder, but it is missing from {here}")


def grammar_path() -> Path:
    return shipped_dir("grammar") / "schedc.lark"


def bundled_schedules() -> list[Path]:
    """The data-parallel schedules, which every verb takes (schedules/*.sched)."""
    return sorted(shipped_dir("schedules").glob("*.sched"))


def pipeline_schedules() -> list[Path]:
    """The pipeline schedules (schedules/pipeline/), which `schedc check` proves and prints,
    `render` draws and `run` runs with the pipeline executor; apart from the others because
    the DP graph, plan and executor, which every bundled DP schedule is put through, do not
    take pipeline stages."""
    return sorted((shipped_dir("schedules") / "pipeline").glob("*.sched"))


def default_schedule() -> Path:
    return shipped_dir("schedules") / DEFAULT_SCHEDULE
