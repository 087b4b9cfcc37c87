"""Hugging Face interop (issue #29): `schedc run --init hf:DIR` and `schedc export`.

A GPT2LMHeadModel is built offline from a GPT2Config of the `nano` sizes, every weight
perturbed (biases and LayerNorms too, so a mapping that drops or swaps one shows), and saved
as save_pretrained writes it (model.safetensors) and as a torch.save state dict
(pytorch_model.bin). One real 2-rank FSDP run starts from it and saves a checkpoint; the
other checks run in this process or fail before any step.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from schedc.cli.main import main
from schedc.compiler import compile_text
from schedc.exec import hf
from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.state import load_parameters
from schedc.model.data import load_batches
from schedc.model.reference import init_model
from tests.ranks import finish, python, start_ranks, torchrun

transformers = pytest.importorskip("transformers")

SCHEDULE = """model nano
world {world}
batch 8 x 32
micro 2
seed 5
{strategy}
"""
DDP = "ddp { bucket b1 = head .. embed }"
# u1 mixes a matrix and vectors: its flat parameter holds them in another order than arch.py's
FSDP = """fsdp {
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = h.1, head
}"""
STRATEGIES = {"ddp": DDP, "fsdp": FSDP}
KEY = bytes(range(32))
# the tests that read the one real 2-rank run (`trained`) share an xdist worker: it runs once
ON_THE_RUN = pytest.mark.xdist_group("hf_run")


def schedule(world: int, strategy: str) -> str:
    return SCHEDULE.format(world=world, strategy=STRATEGIES[strategy])


def hf_config(**changes):
    sizes = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=512)
    return transformers.GPT2Config(**{**sizes, **changes}, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(hf_config()).eval()
    with torch.no_grad():
        for p in m.parameters():  # the tied wte/lm_head once
            p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, hf_model):
    """DIR/safetensors as save_pretrained writes it; DIR/bin the same config with the state
    dict torch.save wrote (lm_head.weight in it, equal to wte)."""
    base = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(base / "safetensors")
    (base / "bin").mkdir()
    shutil.copy(base / "safetensors" / "config.json", base / "bin")
    torch.save(hf_model.state_dict(), base / "bin" / "pytorch_model.bin")
    return base


def tokens(text: str, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    spec = compile_text(text, "t.sched").spec
    return load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size).global_batch(
        step
    )


def hf_logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(x).logits


def schedc_logits(ex, x: torch.Tensor) -> torch.Tensor:
    """The executor's parameters, gathered whole (FSDP: from every shard), in schedc's GPT."""
    model = init_model(ex.spec.model, 0)
    with torch.no_grad():
        for name, t in ex.strategy.full_tensors(grad=False).items():
            model.get_parameter(name).copy_(t)
        return model(x)[0]


def world1_executor(strategy: str):
    from tests.world1 import executor

    return executor(schedule(1, strategy))


# -- in: --init hf:DIR --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_init_gives_the_logits_of_the_hugging_face_model(world1, dirs, hf_model, strategy, fmt):
    ex = world1_executor(strategy)
    spec = ex.spec
    load_parameters(ex, hf.load(dirs / fmt, spec.model, spec.model_name))
    x, _ = tokens(schedule(1, strategy))
    want = hf_logits(hf_model, x)
    got = schedc_logits(ex, x)
    assert (got - want).abs().max().item() < 1e-5
    ex.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dirs):
    """A real 2-rank FSDP run from the safetensors directory: 2 steps, a checkpoint after."""
    base = tmp_path_factory.mktemp("run")
    f = base / "fsdp.sched"
    f.write_text(schedule(2, "fsdp"))
    log, ck = base / "log.jsonl", base / "ck"
    r = torchrun(
        2,
        *(str(f), "--steps", "2", "--init", f"hf:{dirs / 'safetensors'}"),
        *("--save", str(ck), "--log-json", str(log), "--checkpoint-key", str(_key(base))),
    )
    assert r.returncode == 0, r.stderr
    return base, r, [json.loads(line) for line in log.read_text().splitlines()]


def _key(base: Path) -> Path:
    (base / "key").write_bytes(KEY)
    return base / "key"


@pytest.mark.ranks
@ON_THE_RUN
def test_a_two_rank_fsdp_run_starts_from_the_hugging_face_weights(trained, hf_model):
    """Step 0's loss, logged by two FSDP ranks, is Hugging Face's on the same global batch."""
    _, r, records = trained
    assert "schedc: weights of step 0 from hf:" in r.stdout
    x, y = tokens(schedule(2, "fsdp"))
    logits = hf_logits(hf_model, x)
    want = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()
    assert abs(records[0]["loss"] - want) < 1e-5, (records[0]["loss"], want)


PIPELINE = """model nano
world 2
batch 8 x 32
seed 5
pipeline {
  stage s0 = embed, h.0
  stage s1 = h.1, head
  degree 2
  schedule 1f1b
  microbatches 2
}
"""


@pytest.mark.ranks
def test_a_pipeline_run_starts_from_hugging_face_weights_and_skips_a_nonfinite_update(
    dirs, hf_model, tmp_path
):
    """Each pipeline rank takes its stages' weights (the head's rank its tied copy of wte):
    step 0's loss is Hugging Face's on the same global batch, and --tensorboard holds the
    scalars of --log-json. From weights with a NaN in the last block, every loss is not
    finite: under --nonfinite skip each step skips its update on every rank (found_inf, as
    a DP run's) and says which rank and micro-batches."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    f, log, tb = tmp_path / "pp.sched", tmp_path / "log.jsonl", tmp_path / "tb"
    f.write_text(PIPELINE)
    r = torchrun(2, str(f), "--steps", "1", "--init", f"hf:{dirs / 'safetensors'}",
                 "--log-json", str(log), "--tensorboard", str(tb))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "schedc: weights of step 0 from hf:" in r.stdout
    x, y = tokens(PIPELINE)
    logits = hf_logits(hf_model, x)
    want = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()
    [got] = [json.loads(line) for line in log.read_text().splitlines()]
    assert abs(got["loss"] - want) < 1e-5, (got["loss"], want)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (0, pytest.approx(got["loss"], rel=1e-6))
    ]
    poisoned = copy.deepcopy(hf_model)
    with torch.no_grad():
        poisoned.transformer.h[1].ln_2.bias[0] = float("nan")
    poisoned.save_pretrained(tmp_path / "nan")
    log = tmp_path / "nan.jsonl"
    r = torchrun(2, str(f), "--steps", "2", "--init", f"hf:{tmp_path / 'nan'}",
                 "--nonfinite", "skip", "--log-json", str(log))  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in log.read_text().splitlines()]
    assert [g["skipped"] for g in got] == [True, True], got
    assert got[0]["skip_reason"] == (
        "step 0: the loss is not finite in rank 1 micro-step 0, rank 1 micro-step 1"
    )


# -- out: schedc export -------------------------------------------------------------------------


@pytest.mark.ranks
@ON_THE_RUN
def test_export_of_a_sharded_checkpoint_loads_in_transformers_with_schedcs_logits(
    world1, trained, tmp_path, capsys
):
    """The 2-rank FSDP checkpoint (after 2 updates) exported, read by
    GPT2LMHeadModel.from_pretrained: its logits are those of schedc's model resumed from the
    same checkpoint (at world 1, through the resume path, not the exporter's)."""
    base, _, _ = trained
    out = tmp_path / "out"
    assert (
        main(["export", str(base / "ck"), "-o", str(out), "--checkpoint-key", str(_key(base))]) == 0
    )
    said = capsys.readouterr().out
    assert said.startswith("schedc: exported step 2 of ") and "fsdp, world 2" in said
    config = json.loads((out / "config.json").read_text())
    assert config["n_positions"] == config["n_ctx"] == 64 and config["bos_token_id"] is None
    m = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ex = world1_executor("fsdp")
    store.load(ex, base / "ck", key=KEY)
    x, _ = tokens(schedule(1, "fsdp"), step=3)
    assert (hf_logits(m, x) - schedc_logits(ex, x)).abs().max().item() < 1e-5
    ex.close()


def test_hugging_face_to_schedc_to_hugging_face_at_world_1(world1, dirs, hf_model, tmp_path):
    """DDP's checkpoint (whole tensors, not units): the weights come back as they went in."""
    ex = world1_executor("ddp")
    load_parameters(ex, hf.load(dirs / "bin", ex.spec.model, ex.spec.model_name))
    store.save(ex, tmp_path / "ck")
    ex.close()
    # as a user runs it, a process of its own without a process group: it says one line
    r = python("-m", "schedc", "export", str(tmp_path / "ck"), "-o", str(tmp_path / "out"))
    assert r.returncode == 0 and r.stderr == "", r.stderr  # DCP's no-dist warning held back
    assert r.stdout.startswith("schedc: exported step 0 of ")
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x, _ = tokens(schedule(1, "ddp"))
    assert torch.equal(hf_logits(m, x), hf_logits(hf_model, x))


@pytest.mark.ranks
@ON_THE_RUN
def test_export_refuses_a_keyed_checkpoint_without_its_key(trained, tmp_path, capsys):
    base, _, _ = trained
    assert main(["export", str(base / "ck"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("schedc: error: ") and "--checkpoint-key" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"schedc: error: {tmp_path / 'nothing'}: no such checkpoint directory"


# -- refused: code in a pickle, other sizes, other weights on another rank ----------------------


class Canary:
    """Unpickled by plain pickle, it runs a shell command that makes a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def canary_dir(tmp_path, dirs):
    d = tmp_path / "canary"
    d.mkdir()
    shutil.copy(dirs / "bin" / "config.json", d)
    return d


@pytest.mark.parametrize("how", ["pickle.dump", "torch.save"])
def test_a_pickle_that_runs_code_is_refused_without_running_it(canary_dir, how):
    marker = canary_dir.parent / "PWNED"
    gadget = {"transformer.wte.weight": Canary(marker)}
    if how == "pickle.dump":
        (canary_dir / "pytorch_model.bin").write_bytes(pickle.dumps(gadget, protocol=2))
        pickle.loads((canary_dir / "pytorch_model.bin").read_bytes())  # live: plain pickle runs it
        assert marker.exists()
        marker.unlink()
    else:
        torch.save(gadget, canary_dir / "pytorch_model.bin")
    spec = compile_text(schedule(1, "ddp"), "t.sched").spec
    with pytest.raises(hf.HFError, match=r"refused: not weights only.*GLOBAL posix.system"):
        hf.load(canary_dir, spec.model, spec.model_name)
    assert not marker.exists()


def test_schedc_run_refuses_the_canary_in_one_line_exit_1(canary_dir, tmp_path):
    marker = tmp_path / "PWNED"
    (canary_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Canary(marker)}))
    f = tmp_path / "one.sched"
    f.write_text(schedule(1, "ddp"))
    r = python("-m", "schedc", "run", str(f), "--steps", "1", "--init", f"hf:{canary_dir}")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "step    0" not in r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"schedc: error on rank 0: {canary_dir / 'pytorch_model.bin'}: refused")
    assert not marker.exists()


MISMATCH = {
    "n_layer": ({"n_layer": 3}, "n_layer 3, but the schedule's model (nano) has n_layer 2"),
    "n_embd": ({"n_embd": 64}, "n_embd 64, but the schedule's model (nano) has n_embd 32"),
    "vocab": ({"vocab_size": 50257}, "vocab_size 50257, but the schedule's model (nano) has"),
    "n_positions": ({"n_positions": 1024}, "has block_size (n_positions) 64"),
    "untied": ({"tie_word_embeddings": False}, "tie_word_embeddings False; schedc's GPT-2"),
}


@pytest.mark.parametrize("case", MISMATCH)
def test_a_model_of_other_sizes_is_refused_in_one_line(tmp_path, case, capsys):
    changes, said = MISMATCH[case]
    d = tmp_path / "hf"
    hf_config(**changes).save_pretrained(d)  # config.json alone: it is read first
    f = tmp_path / "one.sched"
    f.write_text(schedule(1, "ddp"))
    assert main(["run", str(f), "--init", f"hf:{d}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"schedc: error: {d / 'config.json'}: ") and "\n" not in err
    assert said in err, err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--init", "HF_DIR"], "give hf:DIR, a local Hugging Face GPT-2 directory"),
        (["--init", "hf:/no/such/dir"], "--init hf:/no/such/dir: no such directory"),
        (["--init", "hf:EMPTY"], "no config.json"),
        (["--init", "hf:CONFIG_ONLY"], "neither model.safetensors nor pytorch_model.bin is there"),
        (["--init", "hf:HF_DIR", "--resume", "ck"], "a resumed run continues from its"),
    ],
)
def test_init_flag_errors_are_one_line(tmp_path, dirs, capsys, argv, said):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "CONFIG_ONLY").mkdir()
    shutil.copy(dirs / "bin" / "config.json", tmp_path / "CONFIG_ONLY")
    names = {
        "HF_DIR": dirs / "bin",
        "EMPTY": tmp_path / "EMPTY",
        "CONFIG_ONLY": tmp_path / "CONFIG_ONLY",
    }
    for name, path in names.items():
        argv = [a.replace(name, str(path)) for a in argv]
    f = tmp_path / "one.sched"
    f.write_text(schedule(1, "ddp"))
    assert main(["run", str(f), *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("schedc: error: ") and said in err and "\n" not in err, err


@pytest.mark.ranks
def test_ranks_with_different_init_weights_refuse_to_start(dirs, tmp_path):
    """Rank 0 from the safetensors directory, rank 1 from the .bin one (the same numbers in
    other files): both stop before step 0, naming --init."""
    f = tmp_path / "two.sched"
    f.write_text(schedule(2, "ddp"))
    per_rank = [
        [str(f), "--timeout", "60", "--init", f"hf:{dirs / d}"] for d in ("safetensors", "bin")
    ]
    for code, out, err in finish(start_ranks(per_rank), 120):
        assert code == 1, err
        assert "ranks disagree before step 1" in err and "--init hf:" in err, err
        assert "step    0" not in out
