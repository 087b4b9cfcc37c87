"""HellaSwag (issue #29): schedc's scorer picks, example by example, what build-nanogpt's way
picks when computed independently with Hugging Face's GPT2LMHeadModel on the same weights;
and a HellaSwag file that is not one is a one-line error naming the file and line.

The fixture tests/fixtures/hellaswag_tiny.jsonl is 12 short examples written for these
tests in HellaSwag's format (ctx, 4 endings, label)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from schedc.errors import RunError
from schedc.model.data import gpt2_encoding
from schedc.model.hellaswag import read_hellaswag
from tests.goldens import REPO
from tests.world1 import executor

FIXTURE = REPO / "tests" / "fixtures" / "hellaswag_tiny.jsonl"

# GPT-2's vocabulary (the tokenizer's ids), everything else tiny
SCHEDULE = f"""model nano {{ vocab = 50257  block = 128 }}
world 1
batch 8 x 32
micro 4
seed 3
eval {{ hellaswag = "{FIXTURE}"  hellaswag_every = 1 }}
"""


def hf_model(model):
    """GPT2LMHeadModel of the same shape holding `model`'s weights: HF's Conv1D stores
    (in, out), nn.Linear (out, in), so every attention and MLP matrix is transposed; lm_head
    is tied to wte on both sides."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
        )
    ).eval()
    ours = dict(model.named_parameters())
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    with torch.no_grad():
        for name, p in hf.transformer.named_parameters():
            src = ours[name]
            p.copy_(src.t() if name.endswith(conv1d) else src)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    return hf


def hf_picks(hf, path) -> dict[int, tuple[int, int]]:
    """build-nanogpt's hellaswag.py on the HF model, written out here: per example
    (argmin of the summed, argmin of the mean loss over the ending's tokens)."""
    enc = gpt2_encoding()
    picks = {}
    for i, line in enumerate(path.read_text().splitlines()):
        ex = json.loads(line)
        ctx = enc.encode_ordinary(ex["ctx"])
        sums, means = [], []
        for end in ex["endings"]:
            end_ids = enc.encode_ordinary(" " + end)
            ids = torch.tensor([ctx + end_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0]  # (T, vocab)
            # the ending's tokens are predicted from the positions just before each
            losses = F.cross_entropy(
                logits[len(ctx) - 1 : -1], ids[0, len(ctx) :], reduction="none"
            )
            sums.append(float(losses.sum()))
            means.append(float(losses.mean()))
        picks[i] = (min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__))
    return picks


def test_acc_norm_and_each_pick_equal_transformers_on_the_same_weights(world1):
    from schedc.exec.evaluate import FullModel, HellaSwag

    ex = executor(SCHEDULE, steps=2)
    for _ in range(2):  # trained a little, so the weights are not the seed's alone
        ex.step()
    examples, _ = read_hellaswag(str(FIXTURE), ex.spec.model.block_size)
    scorer = HellaSwag(FullModel(ex), examples)
    score = scorer.score()
    want = hf_picks(hf_model(ex.model), FIXTURE)
    labels = [json.loads(line)["label"] for line in FIXTURE.read_text().splitlines()]
    assert len(examples) == score.total == len(want) == 12
    assert scorer.picks == want
    assert score.correct_norm == sum(want[i][1] == labels[i] for i in want)
    assert score.correct == sum(want[i][0] == labels[i] for i in want)
    assert score.acc_norm == score.correct_norm / 12
    # the picks differ by example and by rule: a scorer that always picked one ending, or
    # the sum where the mean is meant, would not pass
    assert len({p[1] for p in want.values()}) > 1
    assert any(s != m for s, m in want.values())


@pytest.mark.parametrize(
    "line,want",
    [
        ("{not json", ":1: not a JSON object"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', ':1: no "ctx" text'),
        ('{"ctx": "x", "endings": ["a", "b", "c"], "label": 0}', "a list of 4 non-empty texts"),
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 4}', '"label" must be 0-3, got 4'),
        (
            json.dumps({"ctx": "word " * 60, "endings": ["a", "b", "c", "d"], "label": 1}),
            ":1: the context and its longest ending are 62 tokens, more than the model's "
            "context of 32",
        ),
    ],
)
def test_a_line_that_is_not_an_example_is_named(tmp_path, line, want):
    from schedc.model.data import DataError

    f = tmp_path / "h.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(DataError) as e:
        read_hellaswag(str(f), 32)
    assert str(e.value).startswith(str(f)) and want in str(e.value), str(e.value)


def test_a_missing_file_is_one_line_before_any_step(tmp_path):
    """Read at start-up by every rank (exec/train.py), before the ranks agree: a RunError,
    which the CLI prints as one line and exits 1."""
    from schedc.compiler import compile_text
    from schedc.exec.train import read_hellaswag_file

    missing = tmp_path / "hellaswag_val.jsonl"
    spec = compile_text(SCHEDULE.replace(str(FIXTURE), str(missing)), "h.sched").spec
    with pytest.raises(RunError) as e:
        read_hellaswag_file(spec)
    assert str(e.value) == (
        f"hellaswag: {missing}: no such file (HellaSwag is read, never downloaded)"
    )
    examples, seen = read_hellaswag_file(compile_text(SCHEDULE, "h.sched").spec)
    assert examples is not None and len(examples) == 12 and seen.startswith(", hellaswag 12 ex")
