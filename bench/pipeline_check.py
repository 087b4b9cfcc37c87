"""schedc's pipeline checker on written programs, named schedules, or torch's cases.

    python bench/pipeline_check.py --pp 2 -n 2 "0F0 0SEND_F0 ..." "1RECV_F0 ..."   # torch text
    python bench/pipeline_check.py --schedule 1f1b --pp 4 -n 2                     # a named one
    python bench/pipeline_check.py --torch-cases    # bench/pipeline_validators.py's cases (torch)

Prints each finding with the ranks' programs side by side and exits 1 if there is any, or
prints the bubble per rank (F = 1, B = 2, I = W = 1) and exits 0. torch is imported only
for --torch-cases. Until the .sched language has pipelines this is how the checker is run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schedc.ir.pipeline import Pipeline, Programs  # noqa: E402
from schedc.lang.diagnostics import CompileError  # noqa: E402
from schedc.passes.pipeline_check import prove  # noqa: E402
from schedc.passes.pipeline_gen import Request, Schedule, generate  # noqa: E402
from schedc.passes.pipeline_sim import Costs, simulate  # noqa: E402
from tests.pipeline_torch_text import programs_from_torch  # noqa: E402


def verdict(pipe: Pipeline, programs: Programs) -> tuple[int, str]:
    proof = prove(pipe, programs)
    if proof.findings:
        text = "\n".join(f.render(programs) for f in proof.findings)
        return 1, f"{text}\n{len(proof.findings)} error{'s' * (len(proof.findings) > 1)}"
    bubble = simulate(proof.graph, Costs()).bubble
    return 0, "proven; bubble " + ", ".join(f"rank {r} {b:.3f}" for r, b in bubble.items())


def torch_cases() -> int:
    """One line per case of bench/pipeline_validators.py: the codes schedc reports on the
    lists with their transfers (compute-only lists lowered by torch's _add_send_recv)."""
    sys.path.insert(0, str(REPO / "bench"))
    import pipeline_validators as V  # torch

    with V.fake_world():
        for case in V.build_cases():
            print(f"{case.name}: {torch_case(V, case)}")
    return 0


def torch_case(V, case) -> str:
    if case.actions is None:
        req = Request(Schedule.ONE_F_ONE_B, case.pp, case.n)
        try:
            generate(req)
        except CompileError as e:
            return f"[{e.diagnostics[0].code}] {e.diagnostics[0].message}"
        return "generated"
    lists = {r: list(a) for r, a in case.actions.items()}
    if not V._has_comms(lists):
        try:  # torch's own tests lower compute-only lists so; if it cannot, check them as is
            lists = V.S._add_send_recv(lists, case.stage_to_rank, case.num_stages)
        except Exception:
            pass
    progs = programs_from_torch({r: [str(a) for a in acts if a] for r, acts in lists.items()})
    proof = prove(Pipeline(case.pp, case.num_stages, case.n), progs)
    if proof.ok:
        return "proven"
    first = proof.findings[0].diagnostic
    return " ".join(sorted(set(f"[{c}]" for c in proof.codes))) + f" first: {first.message}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lists", nargs="*", help="one rank's torch action text each")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("-n", "--microbatches", type=int, default=2)
    ap.add_argument("--stages", type=int, help="default: pp (v times that for interleaved)")
    ap.add_argument("--schedule", choices=[s.value for s in Schedule])
    ap.add_argument("-v", type=int, default=1, help="stages a rank (interleaved)")
    ap.add_argument("--torch-cases", action="store_true")
    args = ap.parse_args(argv)
    if args.torch_cases:
        return torch_cases()
    if args.schedule:
        try:
            g = generate(Request(Schedule(args.schedule), args.pp, args.microbatches, args.v))
        except CompileError as e:
            print("\n".join(d.render() for d in e.diagnostics), file=sys.stderr)
            return 1
        pipe, progs = g.pipeline, g.programs
    else:
        pipe = Pipeline(args.pp, args.stages or args.pp, args.microbatches)
        progs = programs_from_torch(args.lists)
    rc, text = verdict(pipe, progs)
    print(text, file=sys.stderr if rc else sys.stdout)
    return rc


if __name__ == "__main__":
    sys.exit(main())
