"""GPT-2 parameter-order arithmetic shared by the resolver, the summary and the executor.

When each gradient is complete in backward, the buckets a byte cap makes, and how a
bucket or unit is described the way a person writes it.
"""

from __future__ import annotations

from schedc.ir.spec import BucketSpec
from schedc.model.arch import GPTConfig


def ready_position(cfg: GPTConfig) -> dict[str, int]:
    """Position in backward at which each parameter's gradient is complete (0 = first).

    Backward visits layers in reverse; a parameter is complete after its last writer
    (for the tied wte, that is bwd[embed], the very end). Within a layer, parameters
    complete together; ties are broken by reverse registration order, as DDP does.
    """
    order = {layer: i for i, layer in enumerate(reversed(cfg.layers))}
    pos: dict[str, int] = {}
    for i, p in enumerate(reversed(cfg.params)):
        pos[p.name] = order[cfg.writers(p.name)[-1]] * 10_000 + i
    return pos


def auto_buckets(cfg: GPTConfig, cap: int, first: int) -> list[BucketSpec]:
    """Buckets by size in gradient-ready order; a bucket closes once it reaches its cap.

    The first bucket uses `first` (DDP's small first bucket, so communication starts early).
    """
    ready = ready_position(cfg)
    params = sorted((p.name for p in cfg.params), key=lambda name: ready[name])
    buckets: list[list[str]] = [[]]
    size, limit = 0, first
    for p in params:
        buckets[-1].append(p)
        size += cfg.param(p).nbytes()
        if size >= limit:
            buckets.append([])
            size, limit = 0, cap
    if not buckets[-1]:
        buckets.pop()
    return [
        BucketSpec(f"b{i + 1}", tuple(b), None, sum(cfg.param(p).nbytes() for p in b))
        for i, b in enumerate(buckets)
    ]


def group_by_layer(params: list[str], cfg: GPTConfig) -> list[str]:
    """Name whole layers where all of a layer's parameters are listed, else the parameters."""
    left = set(params)
    out = []
    for layer in cfg.layers:
        names = [p.name for p in cfg.layer_params(layer)]
        if names and all(n in left for n in names):
            out.append(layer)
            left -= set(names)
    return out + [p for p in params if p in left]


def describe_params(cfg: GPTConfig, params) -> str:
    """A bucket's or unit's contents as a person writes them: `head, h.3 .. h.2, wte.weight`.

    Whole layers are named, runs of adjacent whole layers become ranges (listed in the
    order given), and the rest are named parameter by parameter.
    """
    groups = group_by_layer(list(params), cfg)
    layers = [x for x in groups if x in cfg.layers]
    rest = [x for x in groups if x not in cfg.layers]
    idx = sorted(cfg.layer_index(x) for x in layers)
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    backwards = bool(params) and cfg.layer_index(cfg.param(next(iter(params))).layer) > (
        idx[0] if idx else 0
    )
    parts = []
    for run in reversed(runs) if backwards else runs:
        a, b = cfg.layers[run[0]], cfg.layers[run[-1]]
        if backwards:
            a, b = b, a
        parts.append(a if a == b else (f"{a}, {b}" if len(run) == 2 else f"{a} .. {b}"))
    by_layer: dict[str, list[str]] = {}
    for p in rest:
        layer = cfg.param(p).layer
        by_layer.setdefault(layer, []).append(p)
    for layer, ps in by_layer.items():
        if len(ps) == 1 or layer in ("embed", "head"):
            parts += ps
            continue
        subs = list(dict.fromkeys(p[len(layer) + 1 :].rsplit(".", 1)[0] for p in ps))
        parts.append(f"{layer}.{{{', '.join(subs)}}}")
    return ", ".join(parts)
