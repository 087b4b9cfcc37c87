"""The compiler at cluster scale (issue #45): `schedc check` time and peak memory, and a
rank's start-up compile, as the world grows.

    python bench/scale.py                          # every schedule at every world
    python bench/scale.py ddp fsdp --worlds 8 512  # some of them
    python bench/scale.py --limit 120              # seconds a check may take (default 300)

The schedules are the bundled GPT-2 ones with the world (and the batch, so the arithmetic
holds: the same micro-batch and micro-steps a rank) changed:

    ddp    schedules/gpt2_8gpu.sched       DDP, 4 micro-steps of 16 sequences, no_sync
    fsdp   schedules/fsdp_prefetch.sched   FSDP, 4 units, prefetch 1, one micro-step
    hsdp   schedules/gpt2_2x8_hsdp.sched   mesh R x S with S = min(world, 128)
    pp     a 16-stage GPT-2 (30 blocks) 1F1B pipeline of 128 micro-batches, PP 16 x DP
           world / 16

Each check runs in a fresh process (`python -m schedc check FILE`), its wall time and peak
RSS (the child's ru_maxrss) measured; a check that runs past the limit or out of memory is
reported as such. "start-up" is what a rank of `schedc run` compiles before its first step
(bench/startup.py: compiled without the proof, its own plan bound, the plans' digest; the
same process measure). A benchmark to read, not a
test: docs/benchmarks.md records its runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLDS = (8, 64, 512, 4096, 16384)


def _swap(text: str, **fields: str) -> str:
    for key, value in fields.items():
        text, n = re.subn(rf"^{key} .*$", f"{key} {value}", text, count=1, flags=re.M)
        assert n == 1, key
    return text


def ddp(world: int) -> str:
    text = (REPO / "schedules/gpt2_8gpu.sched").read_text()
    return _swap(text, world=str(world), batch=f"{64 * world} x 1024")


def fsdp(world: int) -> str:
    text = (REPO / "schedules/fsdp_prefetch.sched").read_text()
    return _swap(text, world=str(world), batch=f"{8 * world} x 1024")


def hsdp(world: int) -> str:
    shard = min(world, 128)
    text = (REPO / "schedules/gpt2_2x8_hsdp.sched").read_text()
    mesh = f"{world // shard} x {shard}"
    return _swap(text, world=str(world), mesh=mesh, batch=f"{32 * world} x 1024")


def pp(world: int) -> str:
    dp, m = max(1, world // 16), 128
    layers = ["embed", *(f"h.{i}" for i in range(30)), "head"]  # 32 layers, 2 a stage
    stages = "\n".join(f"  stage s{s} = {layers[2 * s]}, {layers[2 * s + 1]}" for s in range(16))
    return f"""model gpt2 {{ n_layer = 30 }}
world {16 * dp}
batch {m * dp} x 1024
steps 50
data corpus
pipeline {{
{stages}
  degree 16
  schedule 1f1b
  microbatches {m}
}}
ddp {{
}}
"""


SCHEDULES = {"ddp": ddp, "fsdp": fsdp, "hsdp": hsdp, "pp": pp}


# runs a module as `python -m` would, writing its peak RSS (KiB) to $PEAK_RSS at exit
WRAP = """import atexit, os, resource, runpy, sys
atexit.register(lambda: open(os.environ["PEAK_RSS"], "w").write(
    str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def measure(module: str, args: list[str], limit: float) -> tuple[str, float, float]:
    """`python -m module args` in a fresh process: (outcome, wall s, its peak RSS in MB)."""
    peak = Path(tempfile.mkstemp(suffix=".rss")[1])
    t0 = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-c", WRAP, module, *args],
            env={**os.environ, "PYTHONPATH": str(REPO), "PEAK_RSS": str(peak)},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return f"over {limit:.0f} s", time.perf_counter() - t0, float("nan")
    wall = time.perf_counter() - t0
    text = peak.read_text()
    peak.unlink()
    rss = int(text) / 1024 if text else float("nan")  # ru_maxrss: KiB on Linux
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or ["?"])[-1][:80]
        return f"exit {out.returncode}: {said}", wall, rss
    proof = re.search(r", ([\d.,]+) ms\)", out.stdout)
    return (f"proof {proof.group(1)} ms" if proof else "ok"), wall, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("schedules", nargs="*", help=f"of {', '.join(SCHEDULES)} (default: all)")
    ap.add_argument("--worlds", nargs="*", type=int, default=list(WORLDS))
    ap.add_argument("--limit", type=float, default=300.0)
    ap.add_argument("--startup", action="store_true", help="also a rank's start-up compile")
    args = ap.parse_args()
    if unknown := set(args.schedules) - set(SCHEDULES):
        ap.error(f"unknown schedule {', '.join(sorted(unknown))}")
    args.schedules = args.schedules or list(SCHEDULES)
    print("| schedule | world | check s | check peak MB | outcome | start-up s | start-up MB |")
    print("|---|---:|---:|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.schedules:
            for world in args.worlds:
                path = Path(tmp) / f"{name}_{world}.sched"
                path.write_text(SCHEDULES[name](world))
                what, wall, rss = measure("schedc", ["check", str(path)], args.limit)
                up = ("", float("nan"), float("nan"))
                if args.startup:
                    up = measure("bench.startup", [str(path), str(world // 2)], args.limit)
                print(
                    f"| {name} | {world:,} | {wall:.1f} | {rss:,.0f} | {what} | "
                    f"{up[1]:.1f} | {up[2]:,.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
