"""Validation loss (issue #29): `eval { val_every = N  val_batches = M }` over the `val`
shard that scripts/make_shards.py writes, logged after every N steps and the last, equal to
one process's mean loss over the same M global batches with the same parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schedc.compiler import compile_text
from schedc.model.data import load_batches
from schedc.model.reference import init_model
from tests.model.test_shards import make_shards_py
from tests.ranks import torchrun

pytestmark = pytest.mark.ranks

SCHEDULE = """model nano
world 2
batch 8 x 32
micro 2
seed 5
data "{d}/"
eval {{ val_every = 2  val_batches = 3 }}
{strategy}
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """3 train shards and 1 val shard of the embedded corpus, as the script cuts them."""
    d = tmp_path_factory.mktemp("shards")
    from schedc.model.data import corpus_tokens

    assert len(make_shards_py.make_shards(np.asarray(corpus_tokens()[:24_000]), d, 6_000)) == 4
    return d


def expected_val_losses(text: str, steps: int, reference) -> dict[int, float]:
    """One process: the reference's parameters after each step, their mean loss over the
    first val_batches global batches of the val stream."""
    spec = compile_text(text, "v.sched").spec
    val = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size, "val")
    model = init_model(spec.model, spec.seed)
    want = {}
    for st in reference(text, steps):
        if (st.step + 1) % spec.evaluation.val_every and st.step + 1 != steps:
            continue
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(st.params[name])
            losses = [model(*val.global_batch(b))[1] for b in range(spec.evaluation.val_batches)]
        want[st.step] = float(torch.stack(losses).double().mean())
    return want


@pytest.mark.parametrize(
    "strategy",
    ["ddp { bucket b1 = head .. embed }", "fsdp { unit all = embed .. head }"],
    ids=["ddp", "fsdp"],
)
def test_two_ranks_log_the_validation_loss_one_process_computes(
    shards, tmp_path, reference, strategy
):
    text = SCHEDULE.format(d=shards, strategy=strategy)
    f, log = tmp_path / "v.sched", tmp_path / "log.jsonl"
    f.write_text(text)
    r = torchrun(2, str(f), "--steps", "5", "--log-json", str(log))
    assert r.returncode == 0, r.stderr
    vals = [line for line in r.stdout.splitlines() if "| val loss" in line]
    assert [v.split("|")[0].split()[1] for v in vals] == ["1/5", "3/5", "4/5"], r.stdout
    got = {
        rec["step"]: rec["val_loss"]
        for rec in map(json.loads, log.read_text().splitlines())
        if "val_loss" in rec
    }
    want = expected_val_losses(text, 5, reference)
    assert got.keys() == want.keys() == {1, 3, 4}
    for step in want:  # fp32, summed in another order across two ranks
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert f"final val loss {got[4]:.6f}" in r.stdout
