"""Evaluation in a run besides the validation loss (issue #29): HellaSwag's counts split
across ranks and all-reduced, samples from rank 0, and --tensorboard's scalars.

One real 2-rank FSDP run (torchrun, shared by the module) with validation, HellaSwag and
samples after every 2 steps and the last, --log-json and --tensorboard; the single-process
oracle's parameters after the same steps give what one process scores. Samples are held
token for token against build-nanogpt's loop in one process. The same eval block in a
2-stage pipeline run logs the same validation losses and HellaSwag counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from schedc.compiler import compile_text
from schedc.errors import RunError
from schedc.model.hellaswag import most_likely, read_hellaswag
from schedc.model.reference import init_model
from tests.exec.test_hellaswag import FIXTURE
from tests.model.test_shards import make_shards_py
from tests.ranks import torchrun
from tests.world1 import executor

PROMPT = "Hello, I'm a language model,"
SCHEDULE = """model nano {{ vocab = 50257  block = 128 }}
world 2
batch 8 x 32
micro 2
seed 5
data "{d}/"
eval {{
  val_every = 2  val_batches = 2
  hellaswag = "{h}"  hellaswag_every = 2
  sample_every = 2  sample_count = 3  sample_tokens = 16
}}
fsdp {{ unit all = embed .. head }}
"""
STEPS = 3  # evaluated after steps 1 (2 done) and 2 (the last)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 2-rank run: (schedule text, stdout, --log-json records, --tensorboard dir)."""
    d = tmp_path_factory.mktemp("evals")
    from schedc.model.data import corpus_tokens

    shards = d / "shards"
    shards.mkdir()
    make_shards_py.make_shards(np.asarray(corpus_tokens()[:24_000]), shards, 6_000)
    text = SCHEDULE.format(d=shards, h=FIXTURE)
    f, log, tb = d / "e.sched", d / "log.jsonl", d / "tb"
    f.write_text(text)
    r = torchrun(2, str(f), "--steps", str(STEPS), "--log-json", str(log), "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    return text, r.stdout, [json.loads(x) for x in log.read_text().splitlines()], tb


@pytest.mark.ranks
def test_hellaswag_split_across_two_ranks_counts_what_one_process_counts(run, reference):
    text, out, records, _ = run
    got = {r["step"]: r for r in records if "hellaswag_acc_norm" in r}
    assert got.keys() == {1, 2}
    spec = compile_text(text, "e.sched").spec
    examples, _ = read_hellaswag(str(FIXTURE), spec.model.block_size)
    model = init_model(spec.model, spec.seed)
    for st in reference(text, STEPS):
        if st.step not in got:
            continue
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(st.params[name])
            picks = [most_likely(e.tokens, e.mask, model(e.tokens)[0]) for e in examples]
        right_norm = sum(p[1] == e.label for p, e in zip(picks, examples, strict=True))
        right = sum(p[0] == e.label for p, e in zip(picks, examples, strict=True))
        rec = got[st.step]
        assert rec["hellaswag_total"] == 12  # each example once, on one rank
        assert (rec["hellaswag_correct_norm"], rec["hellaswag_acc_norm"]) == (
            right_norm,
            right_norm / 12,
        )
        assert rec["hellaswag_acc"] == right / 12
        line = (
            f"| hellaswag acc_norm {right_norm / 12:.4f} ({right_norm}/12) | acc {right / 12:.4f}"
        )
        assert f"step    {st.step}/{STEPS} {line}" in out, out
    last = got[2]
    assert (
        f"final HellaSwag acc_norm {last['hellaswag_acc_norm']:.4f} ({last['hellaswag_correct_norm']}/12)"
        in out
    )


@pytest.mark.ranks
def test_rank_0_logs_its_samples_and_records_them(run):
    _, out, records, _ = run
    lines = [x for x in out.splitlines() if x.startswith("schedc: sample ")]
    samples = [r for r in records if "sample" in r]
    assert [(r["step"], r["sample"]) for r in samples] == [(s, i) for s in (1, 2) for i in range(3)]
    assert lines == [f"schedc: sample {r['sample']}: {r['text']}" for r in samples]  # rank 0's
    for r in samples:
        assert r["text"].startswith(PROMPT) and r["text"] != PROMPT
    assert "; 6 samples logged;" in out


@pytest.mark.ranks
def test_tensorboard_scalars_equal_the_log_json_records(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from schedc.exec.report import SCALARS

    _, _, records, tb = run
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # no MFU on a CPU: every other number of the records is there
    assert tags == set(SCALARS.values()) - {"train/mfu"}, tags
    for key, tag in SCALARS.items():
        want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []
        # TensorBoard keeps a scalar as float32
        assert got == [(s, float(np.float32(v))) for s, v in want], (tag, got, want)
        assert len(want) == {"val_loss": 2, "hellaswag_acc_norm": 2, "hellaswag_acc": 2}.get(
            key, STEPS if key != "mfu" else 0
        )


def build_nanogpt_samples(model, prompt_ids: list[int], count: int, length: int) -> list[list[int]]:
    """build-nanogpt's train_gpt2.py sampling loop, rank 0's."""
    tokens = torch.tensor(prompt_ids, dtype=torch.long).unsqueeze(0).repeat(count, 1)
    xgen = tokens
    sample_rng = torch.Generator(device="cpu")
    sample_rng.manual_seed(42 + 0)
    while xgen.size(1) < length:
        with torch.no_grad():
            logits, _ = model(xgen)
            logits = logits[:, -1, :]
            probs = F.softmax(logits, dim=-1)
            topk_probs, topk_indices = torch.topk(probs, 50, dim=-1)
            ix = torch.multinomial(topk_probs, 1, generator=sample_rng)
            xcol = torch.gather(topk_indices, -1, ix)
            xgen = torch.cat((xgen, xcol), dim=1)
    return xgen.tolist()


def test_samples_are_build_nanogpts_token_for_token(world1):
    from schedc.exec.evaluate import FullModel, Samples
    from schedc.model.data import gpt2_encoding

    text = SCHEDULE.replace("world 2", "world 1").replace('data "{d}/"\n', "")
    text = text.replace("  val_every = 2  val_batches = 2\n", "").format(h=FIXTURE)
    text = text.replace("fsdp { unit all = embed .. head }", "")
    ex = executor(text, steps=1)
    ex.step()
    samples = Samples(FullModel(ex), 3, 16, PROMPT)
    got = samples.texts()
    model = init_model(ex.spec.model, ex.spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ex.params[name])
    enc = gpt2_encoding()
    want = build_nanogpt_samples(model, enc.encode_ordinary(PROMPT), 3, 16)
    assert got == [enc.decode(row) for row in want]
    assert len(set(got)) == 3  # three different draws
    assert samples.texts() == got  # the generator is seeded anew each time, as build-nanogpt's
    # the prompt (8 tokens) counts toward sample_tokens: a length it fills is refused at start
    with pytest.raises(RunError, match="sample_prompt is 8 tokens, and sample_tokens \\(8\\)"):
        Samples(FullModel(ex), 3, 8, PROMPT)


@pytest.mark.ranks
def test_a_pipeline_run_evaluates_as_the_fsdp_run_does(run, tmp_path):
    """The same model, data and eval block as a 2-stage pipeline on 2 ranks (4 micro-batches
    of 2: the same update): its validation losses are the FSDP run's within the suite's fp32
    bound, its HellaSwag counts the same, and rank 0 logs as many samples of the prompt.
    Evaluation reads the whole model, each parameter broadcast from its stage's rank."""
    text, _, want, _ = run
    pipeline = text.replace("micro 2\n", "").replace(
        "fsdp { unit all = embed .. head }",
        "pipeline {\n  stage s0 = embed, h.0\n  stage s1 = h.1, head\n  degree 2\n"
        "  schedule 1f1b\n  microbatches 4\n}",
    )
    f, log = tmp_path / "pp.sched", tmp_path / "pp.jsonl"
    f.write_text(pipeline)
    r = torchrun(2, str(f), "--steps", str(STEPS), "--log-json", str(log))
    assert r.returncode == 0, r.stderr
    got = [json.loads(x) for x in log.read_text().splitlines()]

    def of(records, key):
        return {r["step"]: r[key] for r in records if key in r}

    val, val_want = of(got, "val_loss"), of(want, "val_loss")
    assert val.keys() == val_want.keys() == {1, 2}
    for s in val:
        assert val[s] == pytest.approx(val_want[s], rel=1e-5), (s, val, val_want)
    assert of(got, "hellaswag_correct_norm") == of(want, "hellaswag_correct_norm")
    assert of(got, "hellaswag_total") == of(want, "hellaswag_total")
    samples = [r["text"] for r in got if "sample" in r]
    assert len(samples) == len([r for r in want if "sample" in r]) == 6
    assert all(t.startswith(PROMPT) for t in samples)
