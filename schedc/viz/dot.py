"""DOT for Graphviz: string quoting, schedc's palette, and writing a picture file.

Both views (viz/graph.py, viz/timeline/) build DOT text with these helpers; `write` turns
it into the format the output's extension names (`.dot` is the text itself, no Graphviz).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from schedc.errors import UserError
from schedc.ir.op import Kind

FORMATS = ("svg", "png", "pdf", "dot")
ENGINE = {"graph": "dot", "timeline": "neato"}

# Excalidraw's palette, as in the seed pictures: (fill, stroke)
COLORS = {
    Kind.FWD: ("#a5d8ff", "#1971c2"),
    Kind.BWD: ("#b2f2bb", "#2f9e44"),
    Kind.RECOMPUTE: ("#e5dbff", "#7048e8"),  # a forward again, in backward: its own violet
    Kind.FREE: ("#f1f3f5", "#868e96"),
    Kind.STEP: ("#dee2e6", "#1e1e1e"),
    Kind.ALLREDUCE: ("#ffc9c9", "#e03131"),
    Kind.REDUCESCATTER: ("#ffc9c9", "#e03131"),
    Kind.ALLGATHER: ("#d0ebff", "#1864ab"),
}
# HSDP's collectives over the replicate dimension (the inter-node link): their own colour
REPLICATE_COLORS = ("#e5dbff", "#6741d9")
EVENT_COLOR = "#e8590c"


def colors_of(spec, op) -> tuple[str, str]:
    """(fill, stroke) of an op: its kind's, or the replicate dimension's under HSDP."""
    if spec.hsdp and op.is_collective and spec.dim_of(op) == "replicate":
        return REPLICATE_COLORS
    return COLORS[op.kind]


FONT = "Helvetica"


def q(text: str) -> str:
    """A DOT string literal: newlines become centred line breaks; a written "\\l" stays a
    left-justified one (schedc's own texts hold no other backslashes)."""
    return '"' + text.replace('"', '\\"').replace("\n", "\\n") + '"'


def attrs(**kv) -> str:
    return "[" + ", ".join(f"{k}={v}" for k, v in kv.items() if v is not None) + "]"


def html(text: str) -> str:
    """Escape the few characters HTML-like labels reserve (our <br/> tags pass through)."""
    return (
        text.replace("&", "&amp;")
        .replace("<br/>", "\0")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("\0", "<br/>")
    )


def command(engine: str, dot_file: str, out_file: str) -> str:
    """The Graphviz command line that draws `dot_file` as schedc would: a timeline's nodes
    carry fixed positions, which only `neato -n2` keeps (`dot` would lay them out anew)."""
    fmt = Path(out_file).suffix.lstrip(".").lower()
    pinned = " -n2" if engine == "neato" else ""
    return f"{engine}{pinned} -T{fmt} {dot_file} -o {out_file}"


class GraphvizMissing(UserError):
    """Graphviz, which lays out every format but DOT text, cannot be run here."""


def write(dot: str, out: Path, engine: str) -> None:
    """DOT text to `out`, its format named by the extension (.dot needs no Graphviz)."""
    fmt = out.suffix.lstrip(".").lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        out.write_text(dot)
        return
    if shutil.which(engine) is None:
        raise GraphvizMissing(
            f"writing {out.name} needs Graphviz's `{engine}` program, which is not on PATH; "
            "install Graphviz (Debian/Ubuntu: `sudo apt-get install graphviz`, macOS: "
            "`brew install graphviz`, conda: `conda install graphviz`), or write DOT text "
            f"with -o {out.with_suffix('.dot').name} and render it elsewhere with "
            f"`{command(engine, out.with_suffix('.dot').name, out.name)}`"
        )
    import graphviz

    try:
        data = graphviz.pipe(
            engine, fmt, dot.encode(), neato_no_op=2 if engine == "neato" else None, quiet=True
        )
    except graphviz.ExecutableNotFound as e:  # on PATH but not runnable
        raise GraphvizMissing(f"cannot run Graphviz's `{engine}`: {e}") from None
    out.write_bytes(data)
