"""The flag fuzz (tests/cli/flagfuzz.py) in the suite: 300 cases of check, render, calibrate
and tune in this process, none an internal error, a hang, or a value silently ignored;
`python -m tests.cli.flagfuzz` runs 600 with `run` as well."""

from __future__ import annotations

from tests.cli.flagfuzz import fuzz, summary


def test_fuzzed_flags_of_every_verb_fail_cleanly_or_run(tmp_path):
    outcomes = fuzz(300, 2026, ("check", "render", "calibrate", "tune"), tmp_path)
    failed = [(o.failure, " ".join(o.case.argv), o.err[-600:]) for o in outcomes if o.failure]
    assert not failed, failed[:3]
    print(summary(outcomes))
    for verb in ("check", "render", "calibrate", "tune"):  # the fuzz reaches the work too
        mine = [o for o in outcomes if o.case.verb == verb]
        assert sum(o.code == 0 for o in mine) >= len(mine) // 10, (verb, summary(outcomes))
