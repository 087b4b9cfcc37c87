"""The bundled schedules: every one is legal, the seed-000 pairs agree, and broken copies fail.

Each bundled file is edited into copies that break one rule apiece (a layer dropped from a
bucket, a micro size that does not divide the batch, a written program that reduces
early, ...); every copy must be rejected with that rule's code. The edits are made on the
real text, so the tests follow the files as they change.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from schedc.compiler import Compiled, compile_file, compile_text
from schedc.lang.diagnostics import CompileError
from schedc.lang.resources import bundled_schedules
from tests.goldens import REPO

SCHEDULES = bundled_schedules()
NAMES = [p.name for p in SCHEDULES]


def schedc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "schedc", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


_compiled: dict[str, Compiled] = {}


def compiled(name: str) -> Compiled:
    if name not in _compiled:
        _compiled[name] = compile_file(REPO / "schedules" / name)
    return _compiled[name]


# -- the files as shipped ------------------------------------------------------------------------


def test_the_bundle_is_what_the_seeds_describe():
    assert set(NAMES) == {
        "ddp_overlap.sched",
        "fsdp_prefetch.sched",
        "gpt2_1gpu.sched",
        "gpt2_2x8_fsdp.sched",
        "gpt2_2x8_hsdp.sched",
        "gpt2_8gpu.sched",
        "tiny_1gpu.sched",
        "tiny_4gpu.sched",
        "tiny_ddp_overlap.sched",
        "tiny_fsdp_prefetch.sched",
        "tiny_hsdp.sched",
        "build_nanogpt.sched",  # build-nanogpt's run (issue 29) and its CPU twin
        "build_nanogpt_cpu.sched",
    }


@pytest.mark.parametrize("name", NAMES)
def test_bundled_schedule_compiles_cleanly(name):
    c = compiled(name)
    assert c.warnings == ()
    assert c.plan().ops, "a step has ops"


def test_check_every_bundled_schedule_exits_0():
    r = schedc("check", *(f"schedules/{n}" for n in NAMES))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok\n") == len(NAMES)
    assert r.stderr == ""


def test_gpt2_on_one_gpu_and_on_eight_agree():
    r = schedc("check", "schedules/gpt2_1gpu.sched", "schedules/gpt2_8gpu.sched")
    assert r.returncode == 0, r.stderr
    assert "schedules/gpt2_1gpu.sched: 524,288 tokens per update" in r.stdout
    assert "schedules/gpt2_8gpu.sched: 524,288 tokens per update" in r.stdout
    assert "split     world 1 x micro 16 x 32 micro-steps" in r.stdout
    assert (
        "split     world 8 x micro 16 x 4 micro-steps (no_sync: only the last communicates)"
        in r.stdout
    )
    assert (
        "\nagree: same model, same 512 sequences each read once, every token weighted "
        "1/524288 in the loss" in r.stdout
    )


def test_tiny_on_one_rank_and_on_four_agree():
    r = schedc("check", "schedules/tiny_1gpu.sched", "schedules/tiny_4gpu.sched")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": 1,024 tokens per update") == 2
    assert "\nagree: " in r.stdout


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("lr = 3e-3", "lr = 1e-3", "the optimizers differ in lr: lr=0.001 here, lr=0.003 in"),
        (
            "batch 16 x 64\nmicro 2",
            "batch 32 x 64\nmicro 2",
            "the global batches differ: 32 x 64 here, 16 x 64 in",
        ),
        ("model tiny", "model nano", "the models differ"),
        ("seed 1337", "seed 1", "the seeds differ"),
    ],
    ids=["lr", "batch", "model", "seed"],
)
def test_a_pair_that_differs_is_reported(tmp_path, old, new, says):
    text = (REPO / "schedules/tiny_4gpu.sched").read_text()
    assert old in text
    other = tmp_path / "other.sched"
    other.write_text(text.replace(old, new))
    r = schedc("check", "schedules/tiny_1gpu.sched", str(other))
    assert r.returncode == 1
    assert "[disagree]" in r.stderr and says in r.stderr
    assert r.stderr.startswith(f"{other}:")
    assert "Traceback" not in r.stderr


# -- broken copies of every file -----------------------------------------------------------------


def _setting(text: str, key: str) -> re.Match:
    m = re.search(rf"^{key} (.*?)(\s*#.*)?$", text, re.M)
    assert m, f"no `{key}` line"
    return m


def _replace_line(text: str, key: str, value: str) -> str:
    m = _setting(text, key)
    return text[: m.start(1)] + value + text[m.end(1) :]


def _program_blocks(name: str) -> dict[str, list[str]]:
    """The generated programs of the file (`--dump program`), stream -> instruction lines."""
    out: dict[str, list[str]] = {}
    stream = None
    for line in compiled(name).dump("program").splitlines():
        if line.startswith("program "):
            stream = line.split()[1]
            out[stream] = []
        elif line != "}":
            out[stream].append(line.strip())
    return out


def _block(stream: str, lines: list[str], rank: int | None = None) -> str:
    on = f" on rank {rank}" if rank is not None else ""
    return f"\nprogram {stream}{on} {{\n" + "".join(f"  {x}\n" for x in lines) + "}\n"


def _earlier_layer(name: str, layer: str) -> str:
    """The layer whose backward runs just before `layer`'s (the next one in forward order)."""
    layers = compiled(name).spec.model.layers
    return layers[layers.index(layer) + 1]


def generic_mutations(name: str) -> list[tuple[str, str, str]]:
    """(id, broken text, code) edits that apply to any schedule."""
    text = (REPO / "schedules" / name).read_text()
    spec = compiled(name).spec
    out = [
        ("misspelled-keyword", re.sub(r"^micro ", "mirco ", text, flags=re.M), "syntax"),
        (
            "micro-does-not-divide",
            _replace_line(text, "micro", str(spec.seqs + 1)),
            "batch-arithmetic",
        ),
        (
            "tokens-past-context",
            _replace_line(text, "batch", f"{spec.seqs} x {spec.model.block_size + 1}"),
            "context-length",
        ),
        ("world-zero", _replace_line(text, "world", "0"), "value-range"),
        ("world-twice", text + f"\nworld {spec.world}\n", "duplicate"),
        ("no-batch", re.sub(r"^batch .*$", "", text, flags=re.M), "missing-setting"),
        ("unknown-model", re.sub(r"^model (\S+)", r"model \1x", text, flags=re.M), "unknown-model"),
        (
            "tiny-memory-budget",
            (
                _replace_line(text, "memory", "1 KiB")
                if "\nmemory " in text
                else text + "\nmemory 1 KiB\n"
            ),
            "memory-budget",
        ),
        ("compute-on-comm", text + "\nstream bwd = comm\n", "compute-stream"),
        ("unclosed-block", text + "\nddp {\n  overlap on\n", "unclosed"),
    ]
    progs = _program_blocks(name)
    compute = progs["compute"]
    swapped = [compute[1].split(" after ")[0], compute[0]] + compute[2:]
    out.append(("forward-out-of-order", text + _block("compute", swapped), "out-of-order"))
    comm = progs.get("comm")
    if comm:
        # a reduction launched after an earlier backward than its last writer
        k = next(
            i
            for i, x in enumerate(comm)
            if x.startswith(("allreduce", "reducescatter")) and " after bwd[" in x
        )
        op, after = comm[k].split(" after ")
        layer, mb = re.fullmatch(r"bwd\[(.+)\]@(mb\d+)", after).groups()
        early = comm[:k] + [f"{op} after bwd[{_earlier_layer(name, layer)}]@{mb}"] + comm[k + 1 :]
        out.append(("reduce-early", text + _block("comm", early), "early-reduce"))
        # the optimizer that waits for nothing on the comm stream
        step = [x.split(" after ")[0] if x.startswith("optimizer.step") else x for x in compute]
        out.append(("optimizer-does-not-wait", text + _block("compute", step), "optimizer-wait"))
        # rank 1 issues its first two collectives the other way round
        ops = [x.split(" after ")[0] for x in comm]
        other = [comm[1].split(" after ")[0], comm[0].split(" after ")[0]] + comm[2:]
        if len(ops) >= 2:
            out.append(("rank-1-reorders", text + _block("comm", other, rank=1), "spmd"))
        # an op written twice
        out.append(("collective-twice", text + _block("comm", comm + [ops[0]]), "duplicate-op"))
        # a collective dropped
        out.append(("collective-missing", text + _block("comm", comm[:-1]), "missing-op"))
        if spec.no_sync and spec.accum > 1:
            extra = [comm[k].replace(f"@mb{spec.accum - 1}", "@mb0")]
            out.append(("reduce-under-no-sync", text + _block("comm", extra + comm), "nosync-comm"))
    if spec.kind == "fsdp":
        # free a unit before the last op that reads it
        i = next(i for i, x in enumerate(compute) if x.startswith("free["))
        moved = compute[: i - 1] + [compute[i], compute[i - 1]] + compute[i + 1 :]
        out.append(("free-before-last-reader", text + _block("compute", moved), "use-after-free"))
    return out


# explicit edits of each file: (id, [(old, new), ...], code); an empty `old` appends `new`
DDP_BUCKETS = [
    ("layer-dropped", [("bucket b2 = h.1 .. h.0, embed", "bucket b2 = h.1 .. h.0")], "uncovered"),
    (
        "layer-in-two-buckets",
        [("bucket b1 = head, h.3 .. h.2", "bucket b1 = head, h.3 .. h.1")],
        "double-cover",
    ),
    (
        "layer-past-the-model",
        [("bucket b2 = h.1 .. h.0, embed", "bucket b2 = h.99 .. h.0, embed")],
        "layer-range",
    ),
    ("layer-misspelled", [(".. h.0, embed", ".. h.0, embd")], "unknown-name"),
    ("buckets-and-cap", [("  overlap on", "  bucket_cap 25 MiB\n  overlap on")], "conflict"),
    ("bucket-twice", [("  bucket b2 =", "  bucket b1 =")], "duplicate"),
]
DDP_CAP = [
    (
        "cap-zero",
        [
            ("bucket_cap 25 MiB", "bucket_cap 0 MiB"),
            ("bucket_cap 256 KiB", "bucket_cap 0 KiB"),
            ("bucket_cap 1 MiB", "bucket_cap 0 MiB"),
        ],
        "value-range",
    ),
    (
        "cap-and-buckets",
        [("  overlap on", "  bucket all = embed .. head\n  overlap on")],
        "conflict",
    ),
    (
        "overlap-off-on-comm",
        [("overlap on", "overlap off"), ("", "stream allreduce = comm")],
        "conflict",
    ),
    ("ddp-and-fsdp", [("", "fsdp { unit all = embed .. head }")], "conflict"),
    ("setting-misspelled", [("overlap on", "ovrlap on")], "unknown-setting"),
]
# the recipe's run around the step: evaluations its data and model must allow
RECIPE = [
    (
        "val-without-shards",
        [('data "edu_fineweb10B/"', "data corpus"), ('data "out/shards/"', "data corpus")],
        "value-range",
    ),
    ("samples-in-a-small-vocab", [("{ vocab = 50304 }", "{ vocab = 4096 }")], "conflict"),
    (
        "samples-past-the-context",
        [
            ("sample_tokens = 32", "sample_tokens = 4096"),
            ("sample_tokens = 24", "sample_tokens = 4096"),
        ],
        "context-length",
    ),
]
SINGLE = [
    ("ranks-without-strategy", [("world 1", "world 8")], "missing-setting"),
    (
        "ddp-without-buckets",
        [("data corpus", "data corpus\nddp { overlap on }")],
        "missing-setting",
    ),
    ("optimizer-key-misspelled", [("warmup = ", "warmpu = ")], "unknown-setting"),
    ("lr-zero", [("{ lr = 6e-4", "{ lr = 0"), ("{ lr = 3e-3", "{ lr = 0")], "value-range"),
    ("unknown-data", [("data corpus", "data corpse")], "unknown-name"),
]


def _fsdp_units(
    u1: str, u1_new_tied: str, u2: str, u2_dup: str, u3: str, u3_no_head: str, u3_h99: str
):
    return [
        ("param-dropped", [(u1, u1.replace("wpe.weight, ", ""))], "uncovered"),
        ("layer-in-two-units", [(u2, u2_dup)], "double-cover"),
        ("tied-shared", [("unit tied = wte.weight keep\n", ""), (u1, u1_new_tied)], "tied-param"),
        ("tied-not-kept", [("wte.weight keep", "wte.weight")], "tied-param"),
        ("unit-not-adjacent", [(u3, u3_no_head), (u1, u1 + ", head")], "unit-contiguous"),
        ("layer-past-the-model", [(u3, u3_h99)], "layer-range"),
        ("prefetch-too-deep", [("prefetch forward 1", "prefetch forward 65")], "value-range"),
        ("keep-misspelled", [("wte.weight keep", "wte.weight kep")], "unknown-setting"),
        ("unit-twice", [("unit u2 =", "unit u1 =")], "duplicate"),
        ("fsdp-and-ddp", [("", "ddp { bucket_cap 25 MiB }")], "conflict"),
    ]


GPT2_UNITS = _fsdp_units(
    "unit u1 = wpe.weight, h.0 .. h.1",
    "unit u1 = wte.weight, wpe.weight, h.0 .. h.1",
    "unit u2 = h.2 .. h.3",
    "unit u2 = h.1 .. h.3",
    "unit u6 = h.10 .. h.11, head",
    "unit u6 = h.10 .. h.11",
    "unit u6 = h.10 .. h.99, head",
)

TINY_UNITS = _fsdp_units(
    "unit u1 = wpe.weight, h.0",
    "unit u1 = wte.weight, wpe.weight, h.0",
    "unit u2 = h.1 .. h.2",
    "unit u2 = h.0 .. h.2",
    "unit u3 = h.3, head",
    "unit u3 = h.3",
    "unit u3 = h.99, head",
)

EXPLICIT = {
    "build_nanogpt.sched": DDP_CAP + RECIPE,
    "build_nanogpt_cpu.sched": DDP_CAP + RECIPE,
    "ddp_overlap.sched": DDP_BUCKETS,
    "tiny_ddp_overlap.sched": DDP_BUCKETS,
    "gpt2_8gpu.sched": DDP_CAP,
    "tiny_4gpu.sched": DDP_CAP,
    "gpt2_1gpu.sched": SINGLE,
    "tiny_1gpu.sched": SINGLE,
    "fsdp_prefetch.sched": _fsdp_units(
        "unit u1 = wpe.weight, h.0 .. h.1",
        "unit u1 = wte.weight, wpe.weight, h.0 .. h.1",
        "unit u2 = h.2 .. h.3",
        "unit u2 = h.1 .. h.3",
        "unit u3 = h.4 .. h.5, head",
        "unit u3 = h.4 .. h.5",
        "unit u3 = h.4 .. h.99, head",
    ),
    "gpt2_2x8_fsdp.sched": GPT2_UNITS,
    "gpt2_2x8_hsdp.sched": GPT2_UNITS
    + [
        ("mesh-not-the-world", [("mesh 2 x 8", "mesh 3 x 8")], "mesh-size"),
        ("mesh-of-ddp", [("fsdp {", "ddp { bucket_cap 25 MiB }\nfsdp {")], "conflict"),
    ],
    "tiny_hsdp.sched": TINY_UNITS
    + [("mesh-not-the-world", [("mesh 2 x 2", "mesh 2 x 4")], "mesh-size")],
    "tiny_fsdp_prefetch.sched": _fsdp_units(
        "unit u1 = wpe.weight, h.0",
        "unit u1 = wte.weight, wpe.weight, h.0",
        "unit u2 = h.1 .. h.2",
        "unit u2 = h.0 .. h.2",
        "unit u3 = h.3, head",
        "unit u3 = h.3",
        "unit u3 = h.99, head",
    ),
}


def explicit_mutations(name: str) -> list[tuple[str, str, str]]:
    text = (REPO / "schedules" / name).read_text()
    out = []
    for mid, edits, code in EXPLICIT[name]:
        broken = text
        applied = 0
        for old, new in edits:
            if not old:
                broken += f"\n{new}\n"
                applied += 1
            elif old in broken:
                broken = broken.replace(old, new, 1)
                applied += 1
        assert applied, f"{name}: the edit {mid!r} no longer matches the file"
        out.append((mid, broken, code))
    return out


MUTANTS = [
    pytest.param(name, mid, code, id=f"{name.removesuffix('.sched')}-{mid}")
    for name in NAMES
    for mid, _text, code in generic_mutations(name) + explicit_mutations(name)
]


def _mutant(name: str, mid: str) -> str:
    return next(t for m, t, _ in generic_mutations(name) + explicit_mutations(name) if m == mid)


def test_every_schedule_has_mutants_of_its_own_kind():
    codes: dict[str, set[str]] = {}
    for p in MUTANTS:
        codes.setdefault(p.values[0], set()).add(p.values[2])
    for name in NAMES:
        spec = compiled(name).spec
        assert {
            "syntax",
            "batch-arithmetic",
            "context-length",
            "memory-budget",
            "out-of-order",
        } <= codes[name], name
        if spec.world > 1:
            assert {"early-reduce", "optimizer-wait", "spmd", "missing-op", "conflict"} <= codes[
                name
            ], name
        if "bucket b1" in spec.source.text or spec.kind == "fsdp":
            assert {"uncovered", "double-cover", "layer-range"} <= codes[name], name
        if spec.kind == "fsdp":
            assert {"tied-param", "unit-contiguous", "use-after-free"} <= codes[name], name


@pytest.mark.parametrize("name, mid, code", MUTANTS)
def test_a_broken_copy_is_rejected_with_the_rule_it_breaks(name, mid, code):
    text = _mutant(name, mid)
    with pytest.raises(CompileError) as info:
        compile_text(text, f"broken-{name}")
    e = info.value
    assert code in e.codes, e.render()
    d = next(d for d in e.diagnostics if d.code == code)
    assert d.path == f"broken-{name}"
    if "misspelled" in name:
        assert d.hint and d.hint.startswith("did you mean"), d.render(e.source)
    rendered = e.render()
    assert f"[{code}]" in rendered and "Traceback" not in rendered
