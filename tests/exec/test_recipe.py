"""The bundled recipe is build-nanogpt's GPT-2 run, and its CPU twin trains (#29).

schedules/build_nanogpt.sched against train_gpt2.py's constants, transcribed here from
build-nanogpt (B = 64, T = 1024, total_batch_size = 2**19, max_lr 6e-4, min_lr 10% of it,
warmup_steps 715, max_steps 19073, get_lr, AdamW(betas=(0.9, 0.95), eps=1e-8) with weight
decay 0.1, every 250 steps: 20 validation batches, HellaSwag, 4 samples of max_length 32);
it checks and draws. schedules/build_nanogpt_cpu.sched trains 20 steps on 2 CPU ranks over
shards scripts/make_shards.py makes, with validation and samples.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from schedc.cli.main import main
from schedc.compiler import compile_file
from schedc.ir.spec import Strategy
from tests.goldens import REPO
from tests.ranks import torchrun

RECIPE = REPO / "schedules" / "build_nanogpt.sched"
TWIN = REPO / "schedules" / "build_nanogpt_cpu.sched"


def get_lr(it: int) -> float:
    """build-nanogpt's train_gpt2.py, as written there."""
    max_lr, warmup_steps, max_steps = 6e-4, 715, 19073
    min_lr = max_lr * 0.1
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


def test_the_recipe_is_build_nanogpts_run():
    spec = compile_file(RECIPE).spec
    B, T, ranks = 64, 1024, 8
    assert (spec.world, spec.micro, spec.seq_len) == (ranks, B, T)
    assert spec.tokens_per_step == 2**19 == 524288
    assert spec.accum == 2**19 // (B * T * ranks) == 1
    assert spec.steps == 19073 and spec.seed == 1337
    assert spec.model.vocab_size == 50304 and spec.model.n_layer == 12
    assert spec.model.n_embd == 768 and spec.model.block_size == 1024
    o = spec.optim
    assert (o.weight_decay, o.beta1, o.beta2, o.eps, o.clip) == (0.1, 0.9, 0.95, 1e-8, 1.0)
    for it in [*range(0, 720), *range(720, 19073, 97), 19072, 19073]:
        assert o.lr_at(it, spec.steps) == pytest.approx(get_lr(it), rel=1e-12, abs=1e-15), it
    e = spec.evaluation
    assert (e.val_every, e.val_batches) == (250, 20)
    # build-nanogpt's val_loss_steps = 20 micro-batches of B x T on each of 8 ranks
    assert e.val_batches * spec.seqs == 20 * B * ranks
    assert (e.hellaswag, e.hellaswag_every) == ("hellaswag_val.jsonl", 250)
    assert (e.sample_every, e.sample_count, e.sample_tokens) == (250, 4, 32)
    assert e.sample_prompt == "Hello, I'm a language model,"
    assert spec.kind is Strategy.DDP and spec.data.sharded


def test_the_recipe_and_its_twin_check_and_draw(tmp_path, capsys):
    for f in (RECIPE, TWIN):
        assert main(["check", str(f)]) == 0
        assert main(["render", str(f), "-o", str(tmp_path / f"{f.stem}.dot")]) == 0
        view = ["--view", "timeline", "-o", str(tmp_path / f"{f.stem}_t.dot")]
        assert main(["render", str(f), *view]) == 0
    assert "predicted: every rank: step" in capsys.readouterr().out


@pytest.mark.torch
@pytest.mark.ranks
def test_the_cpu_twin_trains_20_steps_with_validation(tmp_path):
    """The twin as its comment says to run it: shards made by the script into out/shards/
    of the working directory, then 2 ranks for 20 steps."""
    made = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_shards.py"), "-o", "out/shards/"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    r = torchrun(2, str(TWIN), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"(?m)^step +(\d+)/20 \| loss ([\d.]+)", r.stdout)
    assert [int(s) for s, _ in steps] == list(range(20))
    val = re.findall(r"(?m)^step +(\d+)/20 \| val loss ([\d.]+) \| over 4 batches$", r.stdout)
    assert [int(s) for s, _ in val] == [9, 19]
    assert float(val[1][1]) < float(val[0][1]) < float(steps[0][1])  # it learns
    # the spike its comment explains: above a uniform guess at step 8, back at step 9
    loss = [float(x) for _, x in steps]
    assert loss[8] > math.log(50304) > loss[7] > loss[9]
    samples = re.findall(r"(?m)^schedc: sample \d: Hello, I'm a language model,", r.stdout)
    assert len(samples) == 4  # 2 at step 9, 2 after the last
    assert f"final val loss {val[1][1]}" in r.stdout


@pytest.mark.torch
def test_adamw_moves_the_rows_of_ids_never_seen_all_the_same_way(tmp_path, monkeypatch):
    """Why the twin's loss jumps at step 8 (its comment): 346k tokens of one corpus show fewer
    than 1,000 of the padded vocabulary's 50,304 ids in the first steps; the tied wte's rows
    for the rest get gradient only through the softmax, and AdamW's normalized update moves
    each by about lr a coordinate a step whatever that gradient's size, all the same way."""
    import torch

    from schedc.model.data import load_batches
    from schedc.model.reference import Reference

    script = REPO / "scripts" / "make_shards.py"
    made = subprocess.run([sys.executable, str(script), "-o", "out/shards/"], cwd=tmp_path)
    assert made.returncode == 0
    monkeypatch.chdir(tmp_path)
    spec = compile_file(str(TWIN)).spec
    batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
    ref = Reference(spec.model, spec.optim, batches, spec.micro, spec.steps, spec.seed)
    wte = ref.model.get_parameter("wte.weight")
    start = wte.detach().clone()
    seen: set[int] = set()
    for step in range(3):
        x, y = batches.global_batch(step)
        seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        ref.step(record=False)
    assert len(seen) < 1_000
    unseen = torch.tensor(sorted(set(range(spec.model.vocab_size)) - seen))
    drift = (wte.detach() - start)[unseen]
    aligned = torch.nn.functional.cosine_similarity(drift, drift.mean(0, keepdim=True), dim=1)
    assert aligned.mean() > 0.99
    # as far as a seen row, or farther: the step is normalized, not scaled by the gradient
    moved = drift.norm(dim=1).mean()
    assert moved > 0.9 * (wte.detach() - start)[sorted(seen)].norm(dim=1).mean()
