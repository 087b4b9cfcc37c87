"""A rank's start-up compile (what `schedc run` does on a rank other than 0 before its
first step, cli/run.py): the schedule compiled without the proof, this rank's plan bound,
and the plans' digest the ranks agree on.

    python -m bench.startup FILE RANK       # bench/scale.py --startup times it
"""

from __future__ import annotations

import sys

from schedc.compiler import compile_file


def main(path: str, rank: int) -> int:
    c = compile_file(path, prove=False)
    c.bound(rank)
    print(c.plans_digest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2])))
