"""`loss chunk N`: parsed, resolved into the numerics, summarised, judged, compared."""

from __future__ import annotations

import pytest

from schedc.cli.check import summary
from schedc.compiler import compile_text
from schedc.ir.sizes import layer_acts
from schedc.lang.diagnostics import CompileError
from schedc.lang.resolve import Overrides
from schedc.passes.agree import compare
from schedc.passes.dump import dump_ast
from schedc.passes.memory import activation_peak

BASE = "model nano\nworld 1\nbatch 8 x 32\nmicro 2\n"


def codes(text: str) -> list[tuple[str, str]]:
    with pytest.raises(CompileError) as e:
        compile_text(text)
    return [(d.code, d.message) for d in e.value.diagnostics]


def test_resolved_into_the_numerics_and_summarised():
    c = compile_text(BASE + "loss chunk 24\n")
    assert c.spec.numerics.loss_chunk == 24
    assert compile_text(BASE).spec.numerics.loss_chunk is None
    assert "loss in chunks of 24 tokens" in summary(c)
    assert "loss in chunks" not in summary(compile_text(BASE))


def test_dump_ast_shows_the_statement_where_it_was_written():
    out = dump_ast(compile_text(BASE + "loss chunk 1024\n").ast)
    assert "LossChunk @5:1" in out and "tokens: Num(text='1024') @5:12" in out


@pytest.mark.parametrize(
    "value, says",
    [
        ("0", "loss chunk must be >= 1, got 0"),
        ("-3", "loss chunk must be >= 1, got -3"),
        ("2.5", "loss chunk must be a whole number written in digits, not 2.5"),
        ("16777217", "loss chunk must be <= 16,777,216, got 16,777,217"),
    ],
)
def test_bad_values_are_value_range(value, says):
    assert codes(BASE + f"loss chunk {value}\n") == [("value-range", says)]


def test_given_twice_is_a_duplicate():
    assert [c for c, _ in codes(BASE + "loss chunk 8\nloss chunk 16\n")] == ["duplicate"]


def test_precision_flag_keeps_it():
    c = compile_text(BASE + "loss chunk 8\n", overrides=Overrides(precision="bf16"))
    assert c.spec.numerics.loss_chunk == 8 and c.spec.numerics.compute.value == "bf16"


def test_agreement_counts_it_only_below_fp32():
    plain, chunked = compile_text(BASE).spec, compile_text(BASE + "loss chunk 8\n").spec
    assert compare(plain, chunked).agree and compare(plain, chunked).numerics == ()
    bf16 = "precision bf16\n"
    a, b = compile_text(BASE + bf16).spec, compile_text(BASE + bf16 + "loss chunk 8\n").spec
    assert compare(a, b).agree and compare(a, b).numerics == ("loss chunk off vs 8",)


@pytest.mark.parametrize("precision", ["", "precision bf16\n"], ids=["fp32", "bf16"])
def test_the_ledger_counts_no_logits_kept_and_one_chunk_transient(precision):
    """The chunked head makes its gradients in forward (Liger's FusedLinearCrossEntropy):
    from fwd[head] to bwd[head] it keeps ln_f's input and statistics, grad h and the
    weight's fp32 gradient, never an (N, V) tensor; its forward holds one chunk's logits."""
    pc, cc = compile_text(BASE + precision), compile_text(BASE + precision + "loss chunk 16\n")
    plain, chunked = pc.spec, cc.spec
    V, N, C = plain.model.vocab_size, plain.micro * plain.seq_len, plain.model.n_embd
    a, b = layer_acts(plain, "head"), layer_acts(chunked, "head")
    assert a.saved >= N * V * 4  # the unchunked head keeps its log-softmax output
    assert b.saved == N * (2 * C + 2) * 4 + V * C * 4  # ln_f's, grad h, grad weight
    assert b.bwd < a.bwd  # backward only hands the kept gradients on
    one = compile_text(BASE + precision + f"loss chunk {N}\n").spec  # one chunk of them all
    assert layer_acts(one, "head").fwd > b.fwd  # forward's transient: one chunk's logits
    assert activation_peak(chunked, cc.plan()) < activation_peak(plain, pc.plan())
