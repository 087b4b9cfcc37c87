"""docs/pipeline.md's table still holds on the installed torch: each case of
bench/pipeline_validators.py gets, from torch's `_validate_schedule`, its CSV loader,
`_add_send_recv` and `_simulate_comms_compute`, and from the script's point-to-point model,
exactly the verdicts the doc records. A torch upgrade that changes one fails here, and the
doc is rerun (`python bench/pipeline_validators.py`) and updated with it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.goldens import REPO

pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _script():
    spec = importlib.util.spec_from_file_location(
        "pipeline_validators", REPO / "bench" / "pipeline_validators.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict[str, str]]:
    m = _script()
    with m.fake_world():
        cases = [m.check(c) for c in m.build_cases()]
    return {c.name: ({"said": c.said} if c.said else {}) | c.verdicts for c in cases}


EXPECTED = {
    "1f1b-pp2": {
        "said": "_simulate(): ValueError: Unsupported action type 0UNSHARD",
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 20 steps",
        "blocking": "completes",
        "buffered": "completes",
    },
    "1f1b-pp4": {
        "said": "_simulate(): ValueError: Unsupported action type 0UNSHARD",
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 58 steps",
        "blocking": "completes",
        "buffered": "completes",
    },
    "schedule1f1b-ir": {
        "validate": "rejected: AssertionError: Rank 1, step 1: Running Full "
        "Backward for stage 1, microbatch 0 without first running "
        "Forward",
        "load_csv": "rejected: AssertionError: Rank 1, step 1: Running Full "
        "Backward for stage 1, microbatch 0 without first running "
        "Forward",
        "_add_send_recv": "rejected: AssertionError: Malformed compute schedule, "
        "can't schedule sends/recvs",
    },
    "interleaved-pp2": {
        "said": "_simulate(): ValueError: Unsupported action type 0UNSHARD",
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 51 steps",
        "blocking": "completes",
        "buffered": "completes",
    },
    "interleaved-pp2-defer": {
        "said": "_simulate(): ValueError: Unsupported action type 0UNSHARD",
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 42 steps",
        "blocking": "deadlock: rank 0 at 2B0, stream head 2SEND_F1; rank 1 "
        "at 3F1, stream head 3SEND_B0",
        "buffered": "completes",
    },
    "deferred-recv": {
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "completes in 10 steps",
        "blocking": "deadlock: rank 0 at 0B0, stream head 0SEND_F1; rank 1 at 1F1, "
        "stream head 1SEND_B0",
        "buffered": "completes",
    },
    "deferred-recv-172668": {
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 42 steps",
        "blocking": "deadlock: rank 0 at 2F0, stream head 0SEND_F1; rank 1 "
        "at 1F1, stream head 1SEND_F0",
        "buffered": "completes",
    },
    "fifo-inversion": {
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "completes in 12 steps",
        "blocking": "completes; misdelivered 0SEND_F0->1RECV_F1, 0SEND_F1->1RECV_F0",
        "buffered": "completes; misdelivered 0SEND_F0->1RECV_F1, 0SEND_F1->1RECV_F0",
    },
    "few-mb-construct": {
        "said": "ValueError: Number of microbatches (2) must be greater than or "
        "equal to the number of stages (4)."
    },
    "few-mb-1f1b-order": {
        "validate": "rejected: AssertionError: Rank 3, step 1: Running Full "
        "Backward for stage 3, microbatch 0 without first running "
        "Forward",
        "load_csv": "rejected: AssertionError: Rank 3, step 1: Running Full "
        "Backward for stage 3, microbatch 0 without first running "
        "Forward",
        "_add_send_recv": "rejected: AssertionError: Malformed compute "
        "schedule, can't schedule sends/recvs",
    },
    "few-mb-unclamped": {
        "validate": "rejected: AssertionError: Got 3 _ComputationType.FORWARD "
        "microbatches for stage 0, expected 2",
        "load_csv": "rejected: AssertionError: Got 3 _ComputationType.FORWARD "
        "microbatches for stage 0, expected 2",
        "_add_send_recv": "lowered",
        "simulate": "completes in 19 steps",
        "blocking": "error on rank 0: 0F2 is for micro-batch 2, of 2",
        "buffered": "error on rank 0: 0F2 is for micro-batch 2, of 2",
    },
    "few-mb-runtime": {
        "said": "_simulate(): ValueError: Unsupported action type 0UNSHARD",
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 19 steps",
        "blocking": "completes",
        "buffered": "completes",
    },
    "short-error": {
        "validate": "rejected: IndexError: list index out of range",
        "load_csv": "rejected: IndexError: list index out of range",
        "_add_send_recv": "lowered",
        "simulate": "completes in 13 steps",
        "blocking": "completes",
        "buffered": "completes",
    },
    "missing-recv": {
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "stops: ValueError: Schedule is not progressing "
        "(rank=0 next action= 0RECV_B1; rank=1 next action= "
        "1F1)",
        "blocking": "error on rank 1: 1F1 runs before 1RECV_F1 is posted",
        "buffered": "error on rank 1: 1F1 runs before 1RECV_F1 is posted",
    },
    "duplicate-send": {
        "validate": "accepted",
        "load_csv": "accepted",
        "simulate": "stops: ValueError: Unsupported action type 0UNSHARD",
        "simulate w/o DP ops": "completes in 20 steps",
        "blocking": "deadlock: rank 0 at 0B0, stream head 0SEND_F1; rank 1 at 1F2, "
        "stream head 1SEND_B0",
        "buffered": "completes; misdelivered 0SEND_F1->1RECV_F2, "
        "0SEND_F2->1RECV_F3; never received 0SEND_F3",
    },
}


def test_every_case_is_recorded(verdicts):
    assert list(verdicts) == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_torch_and_the_model_say_what_the_doc_records(verdicts, name):
    assert verdicts[name] == EXPECTED[name]
