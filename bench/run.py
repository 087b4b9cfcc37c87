"""schedc against torch's DDP and FSDP2 and the plain loop, side by side in one run.

    python bench/run.py                          # the small model (mini), world 2
    python bench/run.py --model gpt2 --seq 64 --micro 1 --accum 2 --steps 4 --rounds 2
    python bench/run.py --write docs/benchmarks.md   # also record the table there
    python bench/run.py --precision both         # DDP and FSDP pairs in fp32 and in bf16

Every case trains the same model from the same seed on the same global batch and micro
split, on the same machine, with cores/world threads per rank. Cases run as separate
torchrun jobs, interleaved round by round (each round in another order) so drift in the
machine favours no side. Per case: median step time and spread over the timed steps of
all rounds, tokens/s, the ratio to the matching torch baseline (or the plain loop), the
peak live heap and RSS of each rank, the share of communication hidden behind compute (schedc: from
its trace), and the largest gradient difference from the single-process reference at
step 0 (a case that computes something else is void).

`--precision bf16` runs the same pairs under bf16: schedc `precision bf16 { reduce = bf16 }`
against torch DDP with bf16 autocast and its `bf16_compress_hook` (the same arithmetic), and
schedc FSDP `precision bf16` (compute and gather bf16, reduce fp32) against FSDP2 with
bf16 autocast and `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`; each is
checked against the reference run under the same policy (bench/worker.py says how).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's schedc, whatever is installed
OUT = ROOT / "out" / "bench"

HEAD = """model {model}
world {world}
batch {seqs} x {seq}
micro {micro}
steps 100
seed 1337
data corpus
optimizer adamw {{ lr = 3e-4  min_lr = 3e-5  warmup = 2 }}
"""


def schedules(a) -> dict[str, tuple[int, Path]]:
    """case -> (world, schedule file); torch's DDP layout is filled in after its first run."""
    OUT.mkdir(parents=True, exist_ok=True)
    seqs = a.micro * a.accum * a.world
    one = HEAD.format(model=a.model, world=1, seqs=seqs, seq=a.seq, micro=a.micro)
    many = HEAD.format(model=a.model, world=a.world, seqs=seqs, seq=a.seq, micro=a.micro)
    files = {
        "single": one,
        "ddp-cap": many + "ddp {\n  bucket_cap 25 MiB\n  overlap on\n  no_sync on\n}\n",
        "ddp-two": many + f"ddp {{\n  bucket b1 = head .. h.{a.layers // 2}\n"
        f"  bucket b2 = h.{a.layers // 2 - 1} .. embed\n"
        "  overlap on\n  no_sync on\n}\n",
        "fsdp": many
        + "fsdp {\n  unit root = embed, head keep\n"
        + "".join(f"  unit u{i} = h.{i}\n" for i in range(a.layers))
        + "  prefetch forward 1\n  prefetch backward 1\n  reshard_after_forward on\n"
        f"  no_sync {'on' if a.accum > 1 else 'off'}\n}}\n",
    }
    # bf16: DDP reduces in bf16 as torch's bf16_compress_hook does; FSDP gathers in bf16 and
    # reduces in fp32, as MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does
    files["ddp-cap-bf16"] = files["ddp-cap"].replace(
        "ddp {", "precision bf16 { reduce = bf16 }\nddp {", 1
    )
    files["fsdp-bf16"] = files["fsdp"].replace("fsdp {", "precision bf16\nfsdp {", 1)
    # HSDP: the same units on a replicate x shard mesh (FSDP2: a 2-D DeviceMesh)
    if a.world % a.replicate == 0:
        files["hsdp"] = files["fsdp"].replace(
            f"world {a.world}\n",
            f"world {a.world}\nmesh {a.replicate} x {a.world // a.replicate}\n",
        )
    out = {}
    for name, text in files.items():
        path = OUT / f"{name}.sched"
        path.write_text(text)
        out[name] = path
    return out


def torch_layout_schedule(a, layout: list[list[str]]) -> Path:
    """The schedule with exactly torch DDP's buckets, in its launch order."""
    seqs = a.micro * a.accum * a.world
    text = HEAD.format(model=a.model, world=a.world, seqs=seqs, seq=a.seq, micro=a.micro)
    text += "ddp {\n" + "".join(
        f"  bucket b{i + 1} = {', '.join(ps)}\n" for i, ps in enumerate(layout)
    )
    text += "  overlap on\n  no_sync on\n}\n"
    path = OUT / "ddp-torch-layout.sched"
    path.write_text(text)
    return path


def run_case(case: str, world: int, sched: Path, a) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(ROOT / "bench" / "worker.py"),
        "--case",
        case,
        "--schedule",
        str(sched),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
        "PYTHONPATH": str(ROOT),
    }
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{r.stderr[-4000:]}")
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])


# Every case bench/run.py can run: name -> what it trains (the --cases names).
CASES = {
    "loop": "the plain single-process training loop (world 1): the baseline of schedc-single",
    "schedc-single": "schedc, world 1, the same micro split: against loop",
    "torch-ddp": "torch DistributedDataParallel, bucket_cap 25 MiB: the DDP baseline",
    "schedc-ddp-torch-layout": "schedc DDP with exactly torch DDP's buckets (read from "
    "torch-ddp's first run): against torch-ddp",
    "schedc-ddp-cap": "schedc DDP, `bucket_cap 25 MiB`: against torch-ddp",
    "schedc-ddp-two": "schedc DDP, two buckets (seed 003's shape): against torch-ddp",
    "torch-fsdp2": "torch FSDP2 (fully_shard), a unit per block and a root: the FSDP baseline",
    "schedc-fsdp": "schedc FSDP, the same units, prefetch 1 each way: against torch-fsdp2",
    "torch-ddp-bf16": "torch DDP, bf16 autocast and bf16_compress_hook",
    "schedc-ddp-bf16": "schedc DDP, `precision bf16 { reduce = bf16 }`: against torch-ddp-bf16",
    "torch-fsdp2-bf16": "FSDP2, bf16 autocast, MixedPrecisionPolicy(param_dtype=bf16)",
    "schedc-fsdp-bf16": "schedc FSDP, `precision bf16`: against torch-fsdp2-bf16",
    "torch-fsdp2-hsdp": "FSDP2 fully_shard on init_device_mesh('cpu', (R, S), "
    "mesh_dim_names=('replicate', 'shard')): the HSDP baseline (--replicate R)",
    "schedc-hsdp": "schedc FSDP's units on `mesh R x S`: against torch-fsdp2-hsdp",
}
HSDP_CASES = ("torch-fsdp2-hsdp", "schedc-hsdp")
DEFAULT_CASES = {
    "fp32": [c for c in CASES if not c.endswith("-bf16") and c not in HSDP_CASES],
    "bf16": [c for c in CASES if c.endswith("-bf16")],
    "both": ["torch-ddp", "schedc-ddp-cap", "torch-fsdp2", "schedc-fsdp"]
    + [c for c in CASES if c.endswith("-bf16")],
}


def case_list(text: str) -> list[str]:
    """--cases: comma-separated names from CASES."""
    cases = [c.strip() for c in text.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        raise argparse.ArgumentTypeError(
            f"unknown case {', '.join(unknown)}; the cases: {', '.join(CASES)}"
        )
    return cases


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Every case trains the same model, global batch, micro split, seed and data; "
        "each proves its step-0 gradients equal the single-process reference first.",
        epilog="cases (--cases):\n"
        + "".join(f"  {name:<25} {what}\n" for name, what in CASES.items())
        + "\ndefault cases: --precision fp32: "
        + ", ".join(DEFAULT_CASES["fp32"])
        + "; bf16: the *-bf16 cases; both: the fp32 DDP and FSDP pairs and the bf16 ones."
        + "\nThe schedules are written to out/bench/; the table goes to stdout (and --write).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default="mini",
        help="model size of schedc/model/arch.py's SIZES: nano, tiny, mini, gpt2, ... "
        "(default mini, 30M parameters)",
    )
    ap.add_argument(
        "--world", type=int, default=2, help="ranks of the data-parallel cases (default 2)"
    )
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument(
        "--micro", type=int, default=2, help="sequences per rank per micro-step (default 2)"
    )
    ap.add_argument("--accum", type=int, default=2, help="micro-steps per update, k (default 2)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps each case runs first, per round (default 2)",
    )
    ap.add_argument(
        "--replicate",
        type=int,
        default=2,
        help="replicas of the HSDP cases' mesh, R of R x (world / R) (default 2)",
    )
    ap.add_argument(
        "--steps", type=int, default=6, help="timed steps per case per round (default 6)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds; each runs every case once, in a rotated order (default 3)",
    )
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16", "both"),
        default="fp32",
        help="fp32: every case in fp32 (the recorded table); bf16: the DDP and "
        "FSDP pairs under bf16; both: those pairs in fp32 and in bf16",
    )
    ap.add_argument(
        "--cases",
        type=case_list,
        metavar="A,B,...",
        help="comma-separated cases to run, from the list below (default: by --precision)",
    )
    ap.add_argument("--write", metavar="MD", help="record the table in this markdown file")
    return ap


def main() -> None:
    a = parser().parse_args()
    from schedc.model.arch import SIZES

    a.layers = SIZES[a.model].n_layer
    files = schedules(a)
    plan = {  # case -> (worker case, world, schedule, baseline)
        "loop": ("loop", 1, files["single"], None),
        "schedc-single": ("schedc", 1, files["single"], "loop"),
        "torch-ddp": ("torch-ddp", a.world, files["ddp-cap"], None),
        "schedc-ddp-torch-layout": ("schedc", a.world, None, "torch-ddp"),
        "schedc-ddp-cap": ("schedc", a.world, files["ddp-cap"], "torch-ddp"),
        "schedc-ddp-two": ("schedc", a.world, files["ddp-two"], "torch-ddp"),
        "torch-fsdp2": ("torch-fsdp2", a.world, files["fsdp"], None),
        "schedc-fsdp": ("schedc", a.world, files["fsdp"], "torch-fsdp2"),
        "torch-ddp-bf16": ("torch-ddp", a.world, files["ddp-cap-bf16"], None),
        "schedc-ddp-bf16": ("schedc", a.world, files["ddp-cap-bf16"], "torch-ddp-bf16"),
        "torch-fsdp2-bf16": ("torch-fsdp2", a.world, files["fsdp-bf16"], None),
        "schedc-fsdp-bf16": ("schedc", a.world, files["fsdp-bf16"], "torch-fsdp2-bf16"),
        "torch-fsdp2-hsdp": ("torch-fsdp2", a.world, files.get("hsdp"), None),
        "schedc-hsdp": ("schedc", a.world, files.get("hsdp"), "torch-fsdp2-hsdp"),
    }
    assert plan.keys() == CASES.keys(), "CASES lists every case plan runs"
    cases = list(a.cases or DEFAULT_CASES[a.precision])
    if any(c in HSDP_CASES for c in cases) and "hsdp" not in files:
        raise SystemExit(f"--world {a.world} is not a multiple of --replicate {a.replicate}")
    if "schedc-ddp-torch-layout" in cases and "torch-ddp" in cases:
        cases.remove("torch-ddp")
        cases.insert(0, "torch-ddp")  # its layout is needed first
    results: dict[str, list[dict]] = {c: [] for c in cases}
    t0 = time.time()
    for r in range(a.rounds):
        order = cases if r == 0 else cases[r % len(cases) :] + cases[: r % len(cases)]
        for c in order:
            kind, world, sched, _ = plan[c]
            if c == "schedc-ddp-torch-layout" and sched is None:
                layout = results["torch-ddp"][0]["layout"]
                sched = torch_layout_schedule(a, layout)
                plan[c] = (kind, world, sched, plan[c][3])
            res = run_case(kind, world, sched, a)
            results[c].append(res)
            check = res["grad_check"]
            print(
                f"round {r} {c:<26} {res['median_ms']:8.1f} ms  grad diff "
                f"{res['grad_max_abs_diff']:.1e}"
                + (
                    ""
                    if "l2_policy" not in check
                    else f" (beyond rtol {check['beyond_rtol']:.1e}, L2 to policy ref "
                    f"{check['l2_policy']:.2e} vs fp32 ref {check['l2_fp32']:.2e})"
                )
                + ("" if check["ok"] else "  VOID: not the reference's step"),
                flush=True,
            )
    table = summarize(results, plan, a) + memory_lines(results)
    print(table)
    print(f"({time.time() - t0:.0f} s)")
    if a.write:
        record(Path(a.write), table, a)


def summarize(results, plan, a) -> str:
    rows = {}
    for c, runs in results.items():
        times = sorted(t * 1e3 for r in runs for t in r["times"])
        med = statistics.median(times)
        q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
        rows[c] = dict(
            med=med,
            q1=q1,
            q3=q3,
            tok=runs[0]["tokens_per_step"] / (med / 1e3),
            rss=max(max(r["peak_rss_mb"]) for r in runs),
            heap=max(max(r["peak_heap_mb"]) for r in runs),
            hidden=runs[-1]["hidden_fraction"],
            diff=max(r["grad_max_abs_diff"] for r in runs),
            world=runs[0]["world"],
            void=not all(r["grad_check"]["ok"] for r in runs),
        )
    lines = [
        "| case | world | step ms (median) | IQR ms | tokens/s | vs baseline "
        "| peak heap/rank MB | peak RSS/rank MB | comm hidden | grad diff vs ref |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, row in rows.items():
        base = plan[c][3]
        ratio = f"{row['med'] / rows[base]['med']:.3f}x {base}" if base in rows else ""
        hidden = f"{100 * row['hidden']:.0f}%" if row["hidden"] is not None else "n/a"
        void = " VOID" if row["void"] else ""
        lines.append(
            f"| {c} | {row['world']} | {row['med']:.1f} | {row['q1']:.1f}-{row['q3']:.1f} "
            f"| {row['tok']:.0f} | {ratio} | {row['heap']:.0f} | {row['rss']:.0f} | {hidden} "
            f"| {row['diff']:.1e}{void} |"
        )
    return "\n".join(lines)


def memory_lines(results) -> str:
    """schedc's predicted and measured memory per rank (rank 0, last round), as `schedc
    run` prints them: the checker's ledger against the executor's own buffers."""
    out = []
    for c, runs in results.items():
        mem = runs[-1].get("memory")
        if not mem or not any(p or m for p, m in mem.values()):
            continue
        parts = [
            f"{k} {p / 2**20:.1f} predicted, {m / 2**20:.1f} measured MiB"
            + (f" ({100 * (p - m) / m:+.1f}%)" if m else "")
            for k, (p, m) in mem.items()
            if p or m
        ]
        out.append(f"- {c}: " + "; ".join(parts))
    return ("\n\nschedc memory per rank (rank 0):\n\n" + "\n".join(out)) if out else ""


def record(path: Path, table: str, a) -> None:
    """Replace (or add) this configuration's section of the benchmarks document."""
    cmd = " ".join(["python bench/run.py", *sys.argv[1:]])
    title = (
        f"### {a.model}, world {a.world}, batch {a.micro * a.accum * a.world} x {a.seq} "
        f"(micro {a.micro}, k={a.accum})"
    )
    if a.precision != "fp32":
        title = f"### precision {a.precision}: " + title[4:]
    body = (
        f"{title}\n\n`{cmd}` on {platform.machine()}, {os.cpu_count()} cores, "
        f"{a.rounds} rounds x {a.steps} timed steps per case, {time.strftime('%Y-%m-%d')}\n\n"
        f"{table}\n"
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if title in text:
        start = text.index(title)
        end = text.find("\n#", start + 1)  # the next heading, whatever its level
        text = text[:start] + body + ("\n" + text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + body
    path.write_text(text)


if __name__ == "__main__":
    main()
