"""The fail list: for every diagnostic code, a schedule that triggers it, and what it says.

Each case is (snippet, code, message substring, underlined text, hint substring), in the
manner of vyper's fail lists. The underlined text is exactly the source under the caret
(`source.snippet(span)`); None means the diagnostic is about the whole file and points at
no line. A hint of None means the diagnostic has none. Codes that no snippet can reach
(an unreadable file, bytes that are not text, two schedules that differ) have cases of
their own below, and one test proves that every code in CODES has at least one case.
"""

from __future__ import annotations

import pytest

from schedc.compiler import compile_text
from schedc.ir.source import Source
from schedc.lang.diagnostics import CODES, CompileError, Diagnostic, Severity
from schedc.lang.read import MAX_SOURCE_BYTES, read_source, source_from_bytes
from schedc.passes.agree import compare

# -- schedules the cases edit -------------------------------------------------------------------

NANO = "model nano world 2 batch 8 x 32 micro 2\n"  # 2 ranks x micro 2 x k=2
DDP = NANO + "ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed }\n"
FSDP = (  # k=1: one micro-step keeps the written programs short
    "model nano world 2 batch 4 x 32 micro 2\n"
    "fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head }\n"
)

# two stages on two ranks, 1F1B over 4 micro-batches
PP = (
    "model nano world 2 batch 8 x 32 micro 2\n"
    "pipeline {\n  stage s0 = embed, h.0\n  stage s1 = h.1, head\n  schedule 1f1b\n}\n"
)

# ZB-V: four stages on two ranks in a V (rank 0 holds s0 and s3, rank 1 s1 and s2)
PP_V = (
    "model nano world 2 batch 8 x 32 micro 2\n"
    "pipeline {\n  stage s0 = embed\n  stage s1 = h.0\n  stage s2 = h.1\n  stage s3 = head\n"
    "  schedule zb-v\n  placement v\n}\n"
)

# the same pipeline at 2 micro-batches with its ranks' programs written out (1F1B's, as
# `schedc check --dump pipeline` prints them for `schedule 1f1b`)
PP_WRITTEN = (
    "model nano world 2 batch 4 x 32 micro 2\n"
    "pipeline {\n  stage s0 = embed, h.0\n  stage s1 = h.1, head\n"
    "  program on rank 0 { F[s0]@mb0 SEND_F[s0]@mb0 F[s0]@mb1 SEND_F[s0]@mb1+RECV_B[s0]@mb0 "
    "B[s0]@mb0 RECV_B[s0]@mb1 B[s0]@mb1 }\n"
    "  program on rank 1 { RECV_F[s1]@mb0 F[s1]@mb0 RECV_F[s1]@mb1 B[s1]@mb0 SEND_B[s1]@mb0 "
    "F[s1]@mb1 B[s1]@mb1 SEND_B[s1]@mb1 }\n}\n"
)

# DDP's compute stream, written out (what `--dump program` prints for DDP)
DDP_COMPUTE = """\
program compute {
  fwd[embed]@mb0  fwd[h.0]@mb0  fwd[h.1]@mb0  fwd[head]@mb0
  bwd[head]@mb0  bwd[h.1]@mb0  bwd[h.0]@mb0  bwd[embed]@mb0
  fwd[embed]@mb1  fwd[h.0]@mb1  fwd[h.1]@mb1  fwd[head]@mb1
  bwd[head]@mb1  bwd[h.1]@mb1  bwd[h.0]@mb1  bwd[embed]@mb1
  optimizer.step after allreduce[b2]@mb1
}
"""
DDP_COMM = (
    "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1  "
    "allreduce[b2]@mb1 after bwd[embed]@mb1 }\n"
)

# FSDP's compute stream, written out
FSDP_COMPUTE = """\
program compute {
  fwd[embed]@mb0 after allgather[u1]@mb0:fwd
  fwd[h.0]@mb0
  free[u1]@mb0:fwd
  fwd[h.1]@mb0 after allgather[u2]@mb0:fwd
  fwd[head]@mb0
  free[u2]@mb0:fwd
  bwd[head]@mb0 after allgather[u2]@mb0:bwd
  bwd[h.1]@mb0
  free[u2]@mb0:bwd
  bwd[h.0]@mb0 after allgather[u1]@mb0:bwd
  bwd[embed]@mb0
  free[u1]@mb0:bwd
  free[tied]@mb0:bwd
  optimizer.step after reducescatter[u1]@mb0
}
"""


def test_the_written_programs_are_legal():
    """The cases below break these programs one rule at a time; unbroken, they compile."""
    compile_text(DDP + DDP_COMPUTE + DDP_COMM, "t.sched")
    compile_text(FSDP + FSDP_COMPUTE, "t.sched")
    compile_text(PP_WRITTEN, "t.sched")


# -- the fail list -------------------------------------------------------------------------------

FAIL = [
    # input
    pytest.param(
        "modle nano\nworld 1\n",
        "syntax",
        "unexpected 'modle'",
        "modle",
        "did you mean 'model'?",
        id="syntax-keyword-typo",
    ),
    pytest.param(
        "model nano\nworld 1 wrold 2\n",
        "syntax",
        "unexpected 'wrold'",
        "wrold",
        "did you mean 'world'?",
        id="syntax-top-level-typo",
    ),
    pytest.param(
        "model nano\nworld",
        "syntax",
        "unexpected end of file",
        "",
        "expected a number",
        id="syntax-eof",
    ),
    pytest.param(NANO + "@", "syntax", "unexpected '@'", "@", "expected", id="syntax-char"),
    pytest.param(
        DDP + "program comm { alreduce[b1]@mb1 }",
        "syntax",
        "unknown op kind 'alreduce'",
        "alreduce[b1]@mb1",
        "did you mean 'allreduce'?",
        id="syntax-op-kind",
    ),
    pytest.param(
        FSDP + "program comm { allgather[u1]@mb0 }",
        "syntax",
        "allgather needs a phase: 'allgather[u1]@mb0:fwd' or",
        "allgather[u1]@mb0",
        None,
        id="syntax-op-phase",
    ),
    pytest.param(
        NANO + "ddp {\n  bucket b1 = head, h.1, h.0, embed\n",
        "unclosed",
        "this '{' is never closed",
        "{",
        "add '}'",
        id="unclosed",
    ),
    # names and values
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.1  bucket b2 = h.0, emb }",
        "unknown-name",
        "unknown layer or parameter 'emb'",
        "emb",
        "did you mean 'embed'?",
        id="unknown-layer",
    ),
    pytest.param(
        NANO + "ddp { bucket b1 = lm_head, head, h.1  bucket b2 = h.0, embed }",
        "unknown-name",
        "'lm_head' is not a parameter of its own",
        "lm_head",
        "lm_head is tied to the embedding",
        id="unknown-lm-head",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b9]@mb1 }",
        "unknown-name",
        "unknown bucket 'b9' in allreduce[b9]@mb1",
        "allreduce[b9]@mb1",
        "buckets: b1, b2",
        id="unknown-bucket",
    ),
    pytest.param(
        DDP + "program side { allreduce[b1]@mb1 }",
        "unknown-name",
        "unknown stream 'side'",
        "side",
        "streams are compute, comm",
        id="unknown-stream",
    ),
    pytest.param(
        DDP + "stream allreduc = comm",
        "unknown-name",
        "unknown op kind 'allreduc'",
        "allreduc",
        "did you mean 'allreduce'?",
        id="unknown-op-kind",
    ),
    pytest.param(
        DDP + "optimizer sgd",
        "unknown-name",
        "unknown optimizer 'sgd'",
        "sgd",
        "adamw",
        id="unknown-optimizer",
    ),
    pytest.param(
        DDP + "data shakespeare",
        "unknown-name",
        "unknown data source 'shakespeare'",
        "shakespeare",
        "data corpus",
        id="unknown-data",
    ),
    pytest.param(
        DDP + 'data "shards/", "extra.npy", "shards/"',
        "duplicate",
        "'shards/' is listed twice: its tokens would be read twice a pass",
        '"shards/"',
        None,
        id="data-listed-twice",
    ),
    pytest.param(
        DDP + 'data text "a.txt", "b.txt"',
        "value-range",
        "a list of data sources is read as token shards; text is one file",
        '"b.txt"',
        'write `data tokens "a.bin", "b.bin"`, or one text file',
        id="data-text-list",
    ),
    pytest.param(
        "model nano\nworld 1\nbatch 8 x 32\nmicro 2\nmemory 80",
        "value-range",
        "memory needs a unit: 80 what?",
        "80",
        "did you mean `80 MiB`? (`80 B` for bytes)",
        id="size-without-unit",
    ),
    pytest.param(
        "model nano\nworld 2\nbatch 8 x 32\nmicro 2\nddp { bucket_cap 25 }",
        "value-range",
        "bucket_cap needs a unit: 25 what?",
        "25",
        "did you mean `25 MiB`? (`25 B` for bytes)",
        id="bucket-cap-without-unit",
    ),
    pytest.param(
        "model nano\nworld 1\nbatch 8 x 32\nmicro 2\neval { val_every = 5 }",
        "value-range",
        "validation reads the `val` shards, and the embedded corpus has none",
        "val_every = 5",
        'write `data "shards/"` (scripts/make_shards.py makes them), or val_every = 0',
        id="validation-without-shards",
    ),
    pytest.param(
        'model nano\nworld 1\nbatch 8 x 32\nmicro 2\ndata "s/"\neval { val_batches = 0 }',
        "value-range",
        "val_batches must be >= 1, got 0",
        "0",
        None,
        id="val-batches-zero",
    ),
    pytest.param(
        'model nano\nworld 1\nbatch 8 x 32\nmicro 2\ndata "s/"\neval { val_evry = 5 }',
        "unknown-setting",
        "eval has no 'val_evry'",
        "val_evry",
        "did you mean 'val_every'?",
        id="eval-unknown-key",
    ),
    pytest.param(
        "model nano\nworld 1\nbatch 8 x 32\nmicro 2\neval { sample_every = 5 }",
        "conflict",
        "samples decode GPT-2 token ids (tiktoken's gpt2: 50,257), and the model's "
        "vocabulary holds 512",
        "sample_every = 5",
        "`model ... { vocab = 50257 }`",
        id="samples-small-vocab",
    ),
    pytest.param(
        'model nano\nworld 1\nbatch 8 x 32\nmicro 2\neval { hellaswag = "h.jsonl" }',
        "conflict",
        "HellaSwag scores GPT-2 token ids (tiktoken's gpt2: 50,257), and the model's "
        "vocabulary holds 512",
        'hellaswag = "h.jsonl"',
        "which would turn text into noise",
        id="hellaswag-small-vocab",
    ),
    pytest.param(
        "model nano { vocab = 50257 }\nworld 1\nbatch 8 x 32\nmicro 2\n"
        "eval { hellaswag_every = 10 }",
        "missing-setting",
        "hellaswag_every scores nothing without a `hellaswag` file",
        "hellaswag_every = 10",
        'add `hellaswag = "hellaswag_val.jsonl"`',
        id="hellaswag-every-without-file",
    ),
    pytest.param(
        "model nano { vocab = 50257 }\nworld 1\nbatch 8 x 32\nmicro 2\n"
        "eval { sample_every = 5  sample_tokens = 65 }",
        "context-length",
        "samples of 65 tokens exceed the model's context of 64",
        "sample_tokens = 65",
        "sample_tokens = 64 or fewer",
        id="samples-longer-than-context",
    ),
    pytest.param(
        "model nano { vocab = 50257 }\nworld 1\nbatch 8 x 32\nmicro 2\n"
        'eval { sample_every = 5  sample_prompt = " " }',
        "value-range",
        "'sample_prompt' takes one quoted, non-empty text",
        'sample_prompt = " "',
        None,
        id="sample-prompt-blank",
    ),
    pytest.param(
        "model nano { vocab = 50257 }\nworld 1\nbatch 8 x 32\nmicro 2\neval { sample_count = 65 }",
        "value-range",
        "sample_count must be <= 64, got 65",
        "65",
        None,
        id="sample-count-too-many",
    ),
    pytest.param(
        DDP + "optimizer adamw { lr = 1e10 }",
        "value-range",
        "lr = 1e10 is out of range: it must be > 0 and below 1e6",
        "1e10",
        "lr is the peak learning rate (GPT-2 124M: 6e-4)",
        id="lr-too-large",
    ),
    pytest.param(
        "model nano { n_layers = 2 }\nworld 1\nbatch 8 x 32\nmicro 2",
        "unknown-setting",
        "a model has no 'n_layers'",
        "n_layers",
        "did you mean 'n_layer'?",
        id="unknown-model-key",
    ),
    pytest.param(
        DDP + "optimizer adamw { lr = 1e-3  beta = 0.9 }",
        "unknown-setting",
        "adamw has no 'beta'",
        "beta",
        "did you mean 'betas'?",
        id="unknown-optim-key",
    ),
    # a ddp or fsdp block: a misspelled statement, or the other block's, is named with what
    # the block takes (the grammar parses any name where a statement begins)
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.1, h.0, embed  overlp on }",
        "unknown-setting",
        "a ddp block has no 'overlp'",
        "overlp",
        "did you mean 'overlap'?",
        id="ddp-setting-typo",
    ),
    pytest.param(
        NANO + "ddp { bucket_capp 1 MiB }",  # not `bucket_cap` followed by a stray `p`
        "unknown-setting",
        "a ddp block has no 'bucket_capp'",
        "bucket_capp",
        "did you mean 'bucket_cap'?",
        id="ddp-keyword-lengthened",
    ),
    pytest.param(
        NANO + "ddp { bucket_cap_mb = 25 }",  # torch's spelling
        "unknown-setting",
        "a ddp block has no 'bucket_cap_mb'",
        "bucket_cap_mb",
        "did you mean 'bucket_cap'?",
        id="ddp-torch-spelling",
    ),
    pytest.param(
        NANO + "ddp { buckte b1 = head, h.1 .. h.0, embed }",
        "unknown-setting",
        "a ddp block has no 'buckte'",
        "buckte",
        "did you mean 'bucket'?",
        id="ddp-bucket-typo",
    ),
    pytest.param(
        NANO + "ddp { bucket_cap 1 MiB  reshard_after_forward on }",
        "unknown-setting",
        "a ddp block has no 'reshard_after_forward'",
        "reshard_after_forward",
        "`reshard_after_forward` is an fsdp setting; ddp takes bucket, bucket_cap, overlap, "
        "no_sync",
        id="fsdp-keyword-in-ddp",
    ),
    pytest.param(
        NANO + "ddp { bucket_cap 1 MiB  unit u = embed .. head }",
        "unknown-setting",
        "a ddp block has no 'unit'",
        "unit",
        "`unit` is an fsdp setting",
        id="fsdp-unit-in-ddp",
    ),
    pytest.param(
        FSDP.replace(" }", "  overlap on }"),
        "unknown-setting",
        "an fsdp block has no 'overlap'",
        "overlap",
        "`overlap` is a ddp setting; fsdp takes unit, prefetch, reshard_after_forward, no_sync",
        id="ddp-keyword-in-fsdp",
    ),
    pytest.param(
        FSDP.replace(" }", "  prefetch_forward = 2 }"),  # FSDP2's spelling
        "unknown-setting",
        "an fsdp block has no 'prefetch_forward'",
        "prefetch_forward",
        "did you mean 'prefetch'?",
        id="fsdp-setting-typo",
    ),
    pytest.param(
        FSDP.replace("unit u2", "unti u2"),
        "unknown-setting",
        "an fsdp block has no 'unti'",
        "unti",
        "did you mean 'unit'?",
        id="fsdp-unit-typo",
    ),
    pytest.param(
        FSDP.replace("h.1, head", "h.1, head kep"),
        "unknown-setting",
        "an fsdp block has no 'kep'",
        "kep",
        "did you mean 'keep'? (it ends a unit: `unit tied = wte.weight keep`)",
        id="fsdp-keep-typo",
    ),
    pytest.param(
        FSDP.replace(" }", "  frobnicate on }"),
        "unknown-setting",
        "an fsdp block has no 'frobnicate'",
        "frobnicate",
        "fsdp takes unit, prefetch, reshard_after_forward, no_sync",
        id="fsdp-setting-unlike-any",
    ),
    pytest.param(
        "model gpt3\nworld 1\nbatch 8 x 32\nmicro 2",
        "unknown-model",
        "unknown model 'gpt3'",
        "gpt3",
        "did you mean 'gpt2'?",
        id="unknown-model",
    ),
    pytest.param(
        DDP + "world 4",
        "duplicate",
        "'world' is given twice",
        "world 4",
        "keep one of them",
        id="duplicate-world",
    ),
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.1  bucket b1 = h.0, embed }",
        "duplicate",
        "bucket 'b1' is defined twice",
        "b1",
        "give each bucket its own name",
        id="duplicate-bucket",
    ),
    pytest.param(
        "model nano\nworld 1\nmicro 2",
        "missing-setting",
        "the schedule has no 'batch'",
        None,
        "add `batch 512 x 1024`",
        id="missing-batch",
    ),
    pytest.param(
        "model nano\nworld 2\nbatch 8 x 32\nmicro 2",
        "missing-setting",
        "world 2 needs a ddp or fsdp block",
        "world 2",
        "bucket_cap",
        id="missing-strategy",
    ),
    pytest.param(
        NANO + "ddp { overlap on }",
        "missing-setting",
        "the ddp block has no buckets",
        "ddp",
        "bucket_cap 25 MiB",
        id="missing-buckets",
    ),
    pytest.param(
        "model nano\nworld 0\nbatch 8 x 32\nmicro 2",
        "value-range",
        "world must be >= 1, got 0",
        "0",
        "number of data-parallel ranks",
        id="value-world-0",
    ),
    pytest.param(
        "model nano\nworld 1e40\nbatch 8 x 32\nmicro 2",
        "value-range",
        "world must be a whole number written in digits, not 1e40",
        "1e40",
        None,
        id="value-exponent",
    ),
    pytest.param(
        "model nano\nworld 1\nbatch 8 x 32\nmicro 2\nseed -1",
        "value-range",
        "seed must be >= 0, got -1",
        "-1",
        None,
        id="value-negative",
    ),
    pytest.param(
        f"model nano\nworld {10**30}\nbatch 8 x 32\nmicro 2",
        "value-range",
        "world must be <= 65,536, got 1000000000000000000000000000000",
        str(10**30),
        "number of data-parallel ranks",
        id="value-huge",
    ),
    pytest.param(
        DDP + "memory -1 GiB",
        "value-range",
        "memory must be a positive whole number of bytes, got -1 GiB",
        "-1 GiB",
        None,
        id="value-memory",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb7 }",
        "value-range",
        "allreduce[b1]@mb7 names micro-step 7, but this schedule has mb0 .. mb1",
        "allreduce[b1]@mb7",
        None,
        id="value-micro-step",
    ),
    pytest.param(
        "model nano\nworld 1\nbatch 2000000 x 32\nmicro 1",
        "value-range",
        "2,000,000 micro-steps make 16,000,000 forward and backward ops per step; schedc "
        "compiles at most 32,000",
        "micro 1",
        "larger `micro`",
        id="value-too-many-ops",
    ),
    pytest.param(  # under the forward/backward count, over it with FSDP's gathers and frees
        "model nano\nworld 1\nbatch 3000 x 32\nmicro 1\nfsdp { unit all = embed .. head }",
        "value-range",
        "3,000 micro-steps make 39,001 forward, backward, collective and free ops per step",
        "micro 1",
        "larger `micro`",
        id="value-too-many-ops-fsdp",
    ),
    pytest.param(  # the hardening issue's 458-byte schedule: it compiled in 64 s and 2.86 GB
        "model tiny\nworld 2\nbatch 65536 x 64\nmicro 2\nfsdp { unit all = embed .. head }",
        "value-range",
        "16,384 micro-steps make 196,608 forward and backward ops per step",
        "micro 2",
        "larger `micro`",
        id="value-too-many-ops-tiny-fsdp",
    ),
    pytest.param(  # the second was ignored, its unknown unit never said
        NANO + "fsdp { unit all = embed .. head  recompute all  recompute u9 }",
        "duplicate",
        "`recompute` in the fsdp block is given twice",
        "recompute u9",
        "keep one of them",
        id="duplicate-fsdp-recompute",
    ),
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.99  bucket b2 = h.0, embed }",
        "layer-range",
        "the model has no layer h.99",
        "h.99",
        "its blocks are h.0 .. h.1",
        id="layer-range",
    ),
    pytest.param(
        NANO + "ddp { bucket all = embed .. h.7 }",
        "layer-range",
        "the model has no layer h.7",
        "h.7",
        "its blocks are h.0 .. h.1",
        id="layer-range-end",
    ),
    pytest.param(
        "model nano { n_head = 3 }\nworld 1\nbatch 8 x 32\nmicro 2",
        "model-config",
        "n_embd=32 is not divisible by n_head=3",
        "model nano { n_head = 3 }",
        "n_embd must be a multiple of n_head",
        id="model-config",
    ),
    pytest.param(
        DDP + "fsdp { unit all = embed .. head }",
        "conflict",
        "a schedule is either DDP or FSDP, not both",
        "fsdp { unit all = embed .. head }",
        "keep one of the ddp and fsdp blocks",
        id="conflict-ddp-fsdp",
    ),
    pytest.param(
        NANO + "ddp { bucket all = embed .. head  bucket_cap 1 MiB }",
        "conflict",
        "give buckets or a bucket_cap, not both",
        "bucket_cap 1 MiB",
        "drop it or the buckets",
        id="conflict-bucket-cap",
    ),
    pytest.param(
        NANO + "ddp { bucket_cap 1 MiB  overlap off }\nstream allreduce = comm",
        "conflict",
        "overlap off keeps all-reduce on the compute stream",
        "stream allreduce = comm",
        "drop `overlap off`",
        id="conflict-overlap",
    ),
    # numerics
    pytest.param(
        NANO.replace("world 2", "world 1") + "precision bf16 { compute = fp16 }",
        "dtype",
        "compute = fp16 needs dynamic loss scaling",
        "compute = fp16",
        "use `compute = bf16`: the same speed, fp32's range",
        id="dtype-fp16",
    ),
    pytest.param(
        NANO + "precision { gather = bf16 }\nfsdp { unit all = embed .. head }",
        "conflict",
        "gathering in bf16 rounds the weights to it, but compute is fp32",
        "gather = bf16",
        "compute in bf16 too, or gather in fp32",
        id="conflict-gather-without-compute",
    ),
    pytest.param(
        NANO + "precision bf16 { gather = bf16 }\nddp { bucket_cap 1 MiB }",
        "conflict",
        "gather is the dtype FSDP units are all-gathered in; a DDP schedule gathers none",
        "gather = bf16",
        "drop `gather`, or use an fsdp block",
        id="conflict-gather-ddp",
    ),
    pytest.param(
        NANO.replace("world 2", "world 1") + "precision bf17",
        "unknown-name",
        "unknown precision policy 'bf17'",
        "bf17",
        "did you mean 'bf16'?",
        id="unknown-precision",
    ),
    pytest.param(
        NANO.replace("world 2", "world 1") + "precision { reduce = fp8 }",
        "value-range",
        "reduce takes one dtype: fp32 or bf16",
        "reduce = fp8",
        None,
        id="precision-dtype-name",
    ),
    pytest.param(
        NANO.replace("world 2", "world 1") + "precision { recude = bf16 }",
        "unknown-setting",
        "precision has no 'recude'",
        "recude",
        "did you mean 'reduce'?",
        id="precision-key-typo",
    ),
    # batch arithmetic
    pytest.param(
        NANO.replace("micro 2", "micro 3") + "ddp { bucket_cap 1 MiB }",
        "batch-arithmetic",
        "global batch 8 is not micro 3 x world 2 x a whole number of micro-steps",
        "micro 3",
        "for example micro 1 (k=4), micro 2 (k=2), micro 4 (k=1)",
        id="batch-micro",
    ),
    pytest.param(
        NANO + "accumulate 4\nddp { bucket_cap 1 MiB }",
        "batch-arithmetic",
        "micro 2 x accumulate 4 x world 2 = 16 sequences, but the global batch is 8",
        "accumulate 4",
        "for example",
        id="batch-accumulate",
    ),
    pytest.param(
        NANO.replace("x 32", "x 65") + "ddp { bucket_cap 1 MiB }",
        "context-length",
        "sequences of 65 tokens do not fit the model's context of 64",
        "65",
        "use at most 64 tokens",
        id="context-length",
    ),
    # the mesh
    pytest.param(
        FSDP + "mesh 2 x 2",
        "mesh-size",
        "mesh 2 x 2 is 4 ranks, but the world is 2",
        "mesh 2 x 2",
        "for world 2: 2 x 1, 1 x 2",
        id="mesh-size",
    ),
    pytest.param(
        DDP.replace("world 2", "world 4").replace("batch 8", "batch 16") + "mesh 2 x 2",
        "mesh-ddp",
        "a ddp schedule shards nothing: its mesh is 4 x 1, not 2 x 2",
        "mesh 2 x 2",
        "write `mesh 4 x 1`, or use an fsdp block to shard over 2 ranks",
        id="mesh-ddp",
    ),
    pytest.param(
        FSDP + "mesh 0 x 2",
        "value-range",
        "mesh replicate size must be >= 1, got 0",
        "0",
        None,
        id="mesh-zero",
    ),
    pytest.param(
        FSDP + "mesh 1 x 2\nmesh 2 x 1",
        "duplicate",
        "the mesh is given twice",
        "mesh 2 x 1",
        "keep one of them",
        id="mesh-twice",
    ),
    # coverage and sharding
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.1  bucket b2 = embed }",
        "uncovered",
        "h.0 is in no bucket",
        "ddp",
        "add h.0 to one",
        id="uncovered-bucket",
    ),
    pytest.param(
        FSDP.replace("unit tied = wte.weight keep  ", ""),
        "uncovered",
        "wte.weight is in no unit",
        "fsdp",
        "add wte.weight to one",
        id="uncovered-unit",
    ),
    pytest.param(
        NANO + "ddp { bucket b1 = head, h.1, h.0  bucket b2 = h.0, embed }",
        "double-cover",
        "h.0 is in both bucket 'b1' and bucket 'b2'",
        "h.0",
        "exactly one bucket",
        id="double-cover",
    ),
    pytest.param(
        NANO + "fsdp { unit u1 = embed, h.0  unit u2 = h.1, head }",
        "tied-param",
        "unit 'u1' holds wte.weight, which embed and head both read",
        "unit u1 = embed, h.0",
        "`unit tied = wte.weight keep`",
        id="tied-param",
    ),
    pytest.param(
        FSDP.replace("wte.weight keep", "wte.weight"),
        "tied-param",
        "unit 'tied' holds wte.weight",
        "unit tied = wte.weight",
        "stays gathered",
        id="tied-param-alone",
    ),
    pytest.param(
        NANO + "fsdp { unit tied = wte.weight keep  unit u1 = h.0, head  "
        "unit u2 = wpe.weight, h.1 }",
        "unit-contiguous",
        "unit 'u1' is read by layers h.0, head, which are not adjacent",
        "unit u1 = h.0, head",
        "contiguous range of layers",
        id="unit-contiguous",
    ),
    pytest.param(
        DDP + "memory 1 KiB",
        "memory-budget",
        "predicted peak 1.32 MiB per rank (at bwd[head]@mb0) exceeds the budget of 1.00 KiB; "
        "the largest part is model states (model states 686.00 KiB, activations 669.75 KiB)",
        "memory 1 KiB",
        "raise `memory`",
        id="memory-ddp",
    ),
    pytest.param(
        FSDP + "memory 100 KiB",
        "memory-budget",
        "per rank (at bwd[head]@mb0) exceeds the budget of 100.00 KiB; the largest part is "
        "activations (activations 668.75 KiB, model states 257.25 KiB",
        "memory 100 KiB",
        "recompute layers (`recompute h.0 .. h.N`)",
        id="memory-fsdp",
    ),
    # streams and events
    pytest.param(
        DDP
        + DDP_COMPUTE.replace("bwd[head]@mb1 ", "bwd[head]@mb1 after allreduce[b1]@mb1 ")
        + DDP_COMM,
        "cycle",
        "the schedule waits in a circle: bwd[head]@mb1 -> bwd[h.1]@mb1 -> "
        "allreduce[b1]@mb1 -> bwd[head]@mb1",
        "bwd[h.1]@mb1",
        "break one of the waits",
        id="cycle",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after allreduce[b2]@mb1  "
        "allreduce[b2]@mb1 after bwd[embed]@mb1 }",
        "deadlock",
        "allreduce[b1]@mb1 waits for allreduce[b2]@mb1, which comes later on stream 'comm'",
        "allreduce[b2]@mb1",
        "a stream runs in order",
        id="deadlock",
    ),
    pytest.param(
        DDP + "stream fwd = comm",
        "compute-stream",
        "fwd is compute work and runs on the compute stream, not 'comm'",
        "comm",
        "only collectives can move",
        id="compute-stream-decl",
    ),
    pytest.param(
        DDP + "program comm { fwd[h.0]@mb0 }",
        "compute-stream",
        "fwd[h.0]@mb0 is compute work, written on stream 'comm'",
        "fwd[h.0]@mb0",
        "write it in `program compute`",
        id="compute-stream-program",
    ),
    pytest.param(
        FSDP + FSDP_COMPUTE.replace("fwd[embed]@mb0 after allgather[u1]@mb0:fwd", "fwd[embed]@mb0"),
        "missing-event",
        "fwd[embed]@mb0 on stream 'compute' needs allgather[u1]@mb0:fwd on stream "
        "'comm' (gathered parameters) but nothing makes it wait",
        "fwd[embed]@mb0",
        "write `fwd[embed]@mb0 after allgather[u1]@mb0:fwd`",
        id="missing-event",
    ),
    pytest.param(
        DDP + DDP_COMPUTE.replace("fwd[embed]@mb0  fwd[h.0]@mb0", "fwd[h.0]@mb0  fwd[embed]@mb0"),
        "out-of-order",
        "fwd[h.0]@mb0 comes before fwd[embed]@mb0 on stream 'compute', but needs its activation",
        "fwd[h.0]@mb0",
        "place fwd[embed]@mb0 first",
        id="out-of-order",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1 }",
        "missing-op",
        "bucket 'b2' is never all-reduced in micro-step 1",
        "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1 }",
        "add `allreduce[b2]@mb1` to `program comm`",
        id="missing-op",
    ),
    pytest.param(
        FSDP + "program comm { allreduce[b1]@mb0 }",
        "unexpected-op",
        "allreduce[b1]@mb0 has no place in an FSDP schedule",
        "allreduce[b1]@mb0",
        "FSDP schedules gather, free and reduce-scatter units",
        id="unexpected-kind",
    ),
    pytest.param(
        DDP + "program comm { SEND_F[s0]@mb0 }",
        "unexpected-op",
        "SEND_F[s0]@mb0 is a pipeline stage's action, in a program of the plan",
        "SEND_F[s0]@mb0",
        "stage actions go in `program on rank N` of a pipeline block",
        id="stage-action-in-a-plan",
    ),
    pytest.param(
        FSDP.replace("head }", "head  reshard_after_forward off }")
        + "program comm { allgather[tied]@mb0:fwd  allgather[u1]@mb0:fwd  "
        "allgather[u2]@mb0:fwd  allgather[u2]@mb0:bwd\n"
        "  reducescatter[u2]@mb0 after bwd[h.1]@mb0  reducescatter[tied]@mb0 after "
        "bwd[embed]@mb0  reducescatter[u1]@mb0 }",
        "unexpected-op",
        "allgather[u2]@mb0:bwd is not part of this schedule (reshard_after_forward is "
        "off, so u2 stays gathered for backward)",
        "allgather[u2]@mb0:bwd",
        "--dump program",
        id="unexpected-gather",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1  allreduce[b2]@mb1 "
        "after bwd[embed]@mb1, allreduce[b2]@mb0 }",
        "unexpected-op",
        "this waits for allreduce[b2]@mb0, which is not part of this schedule (no_sync "
        "keeps mb0 local",
        "allreduce[b2]@mb0",
        "--dump program",
        id="unexpected-after",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1  allreduce[b1]@mb1  "
        "allreduce[b2]@mb1 after bwd[embed]@mb1 }",
        "duplicate-op",
        "allreduce[b1]@mb1 is written twice",
        "allreduce[b1]@mb1",
        "each op runs once per step",
        id="duplicate-op",
    ),
    # gradients
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[head]@mb1  "
        "allreduce[b2]@mb1 after bwd[embed]@mb1 }",
        "early-reduce",
        "allreduce[b1]@mb1 can start before bwd[h.1]@mb1 has written its gradients",
        "allreduce[b1]@mb1 after bwd[head]@mb1",
        "write `allreduce[b1]@mb1 after bwd[h.1]@mb1`",
        id="early-reduce",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[h.1]@mb1  "
        "allreduce[b2]@mb1 after bwd[h.0]@mb1 }",
        "early-reduce",
        "before bwd[embed]@mb1 has written its gradients (the tied wte/lm_head weight "
        "gets its last gradient from bwd[embed])",
        "allreduce[b2]@mb1 after bwd[h.0]@mb1",
        "write `allreduce[b2]@mb1 after bwd[embed]@mb1`",
        id="early-reduce-tied",
    ),
    pytest.param(
        DDP + "program comm { allreduce[b1]@mb0 after bwd[h.1]@mb0  "
        "allreduce[b1]@mb1 after bwd[h.1]@mb1  allreduce[b2]@mb1 after bwd[embed]@mb1 }",
        "nosync-comm",
        "allreduce[b1]@mb0 communicates in micro-step 0, but no_sync "
        "keeps gradients local until the last (mb1)",
        "allreduce[b1]@mb0 after bwd[h.1]@mb0",
        "set `no_sync off`",
        id="nosync-comm",
    ),
    pytest.param(
        DDP + DDP_COMPUTE.replace("after allreduce[b2]@mb1", "after allreduce[b1]@mb1"),
        "optimizer-wait",
        "the optimizer step does not wait for allreduce[b2]@mb1",
        "optimizer.step after allreduce[b1]@mb1",
        "write `optimizer.step after allreduce[b2]@mb1`",
        id="optimizer-wait",
    ),
    # sharding at run time
    pytest.param(
        FSDP
        + FSDP_COMPUTE.replace(
            "fwd[h.0]@mb0\n  free[u1]@mb0:fwd\n", "free[u1]@mb0:fwd\n  fwd[h.0]@mb0\n"
        ),
        "use-after-free",
        "free[u1]@mb0:fwd releases 'u1' while fwd[h.0]@mb0 may still read it",
        "free[u1]@mb0:fwd",
        "free a unit only after its last reader",
        id="use-after-free",
    ),
    # recomputation: u2 (h.1, head) recomputes; the compute stream written out
    pytest.param(
        FSDP.replace("unit u2 = h.1, head }", "unit u2 = h.1, head  recompute u2 }")
        + FSDP_COMPUTE.replace(
            "  bwd[head]@mb0 after allgather[u2]@mb0:bwd\n  bwd[h.1]@mb0\n",
            "  recompute[head]@mb0\n  bwd[head]@mb0 after allgather[u2]@mb0:bwd\n"
            "  recompute[h.1]@mb0\n  bwd[h.1]@mb0\n",
        ),
        "recompute-gather",
        "recompute[head]@mb0 reruns head's forward before allgather[u2]@mb0:bwd gathers 'u2'",
        "recompute[head]@mb0",
        "write `recompute[head]@mb0 after allgather[u2]@mb0:bwd`",
        id="recompute-gather",
    ),
    pytest.param(
        "recompute h.1\n"
        + DDP
        + DDP_COMPUTE.replace("bwd[h.1]@mb0", "bwd[h.1]@mb0  recompute[h.1]@mb0").replace(
            "bwd[h.1]@mb1", "recompute[h.1]@mb1  bwd[h.1]@mb1"
        ),
        "recompute-late",
        "bwd[h.1]@mb0 reads the activations recompute[h.1]@mb0 rebuilds, but can start before it",
        "bwd[h.1]@mb0",
        "place recompute[h.1]@mb0 right before bwd[h.1]@mb0",
        id="recompute-late",
    ),
    pytest.param(
        DDP + DDP_COMPUTE.replace("bwd[h.1]@mb0", "recompute[h.1]@mb0  bwd[h.1]@mb0"),
        "recompute-freed",
        "recompute[h.1]@mb0 reruns h.1's forward from its input, but h.1 does not recompute",
        "recompute[h.1]@mb0",
        "declare `recompute h.1`",
        id="recompute-freed",
    ),
    # SPMD
    pytest.param(
        DDP + "program comm on rank 1 { allreduce[b2]@mb1 after bwd[embed]@mb1  "
        "allreduce[b1]@mb1 after bwd[h.1]@mb1 }",
        "spmd",
        "rank 1 issues allreduce[b2]@mb1 as collective #1 on stream 'comm', where the "
        "other ranks issue allreduce[b1]@mb1",
        "allreduce[b2]@mb1 after bwd[embed]@mb1",
        "a mismatch hangs gloo and NCCL",
        id="spmd",
    ),
    # pipeline stages
    pytest.param(
        PP.replace("embed, h.0", "embed, h.1").replace("h.1, head", "h.0, head"),
        "stage-order",
        "stage 's0' is not one run of layers: it skips h.0",
        "stage s0 = embed, h.1",
        "a stage is a contiguous range of layers",
        id="stage-order-gap",
    ),
    pytest.param(
        PP.replace(
            "s0 = embed, h.0\n  stage s1 = h.1, head", "s0 = h.1, head\n  stage s1 = embed, h.0"
        ),
        "stage-order",
        "stage 's0' begins at h.1, but the first stage holds embed",
        "stage s0 = h.1, head",
        "list the stages in model order",
        id="stage-order-order",
    ),
    pytest.param(
        PP.replace("stage s1 = h.1, head", "stage s1 = h.1\n  stage s2 = head"),
        "stage-count",
        "1f1b runs one stage a rank: 3 stages on 2 ranks",
        "schedule 1f1b",
        "declare 2 stages, or use interleaved",
        id="stage-count",
    ),
    pytest.param(
        PP.replace("1f1b", "interleaved"),
        "stage-count",
        "interleaved runs v >= 2 stages on each of its 2 ranks; 2 stages are not that",
        "schedule interleaved",
        "declare 4 or 6 stages",
        id="stage-count-interleaved",
    ),
    pytest.param(
        PP.replace("1f1b", "zb-v\n  placement v"),
        "stage-count",
        "zb-v runs 2 stages on each of its 2 ranks, in a V; 2 stages are not that",
        "schedule zb-v",
        "declare 4 stages, or use zb-h1",
        id="stage-count-zb-v",
    ),
    pytest.param(
        PP_V.replace("placement v", "placement loop"),
        "conflict",
        "zb-v places its stages in a V (rank r holds stages r and 3 - r), not in a loop",
        "placement loop",
        "write `placement v`",
        id="conflict-zb-v-placement",
    ),
    pytest.param(
        PP_V.replace("  placement v\n", ""),
        "conflict",
        "not in a loop (the default placement)",
        "schedule zb-v",
        "write `placement v` in the pipeline block",
        id="conflict-zb-v-default-placement",
    ),
    pytest.param(
        PP_V.replace("zb-v", "interleaved"),
        "conflict",
        "interleaved-1f1b places its stages in a loop; of the named schedules only zb-v runs a V",
        "placement v",
        "write `placement loop`, or `schedule zb-v`",
        id="conflict-interleaved-placement-v",
    ),
    pytest.param(
        PP.replace("h.1, head", "head"),
        "uncovered",
        "h.1 is in no stage",
        "pipeline",
        "every parameter must be in exactly one stage",
        id="uncovered-stage",
    ),
    pytest.param(
        PP.replace("h.1, head", "h.0 .. head"),
        "double-cover",
        "h.0 is in both stage 's0' and stage 's1'",
        "h.0 .. head",
        "a parameter belongs to exactly one stage",
        id="double-cover-stage",
    ),
    pytest.param(
        PP.replace("h.1, head", "h.1 .. h.7"),
        "layer-range",
        "the model has no layer h.7",
        "h.7",
        "its blocks are h.0 .. h.1",
        id="layer-range-stage",
    ),
    pytest.param(
        PP.replace("batch 8 x 32 micro 2", "batch 2 x 32").replace(
            "schedule 1f1b", "schedule 1f1b\n  microbatches 1"
        ),
        "pp-microbatches",
        "1f1b on 2 stages needs >= 2 micro-batches, got 1",
        "microbatches 1",
        "use gpipe, or m >= 2",
        id="pp-microbatches",
    ),
    pytest.param(
        PP.replace("micro 2", "").replace("schedule 1f1b", "schedule 1f1b\n  microbatches 3"),
        "batch-arithmetic",
        "global batch 8 is not microbatches 3 x dp 1 x a whole number of sequences",
        "microbatches 3",
        "micro 2 (k=4)",
        id="batch-arithmetic-pipeline",
    ),
    pytest.param(
        PP + "ddp { bucket a = head, h.1 .. h.0  bucket b = embed }\n",
        "conflict",
        "bucket 'a' spans stages 's0' and 's1': a pipeline all-reduces each stage's "
        "gradients over its own replicas",
        "bucket a = head, h.1 .. h.0",
        "split the bucket where the stages meet",
        id="conflict-pipeline-bucket-across-stages",
    ),
    pytest.param(
        PP + "ddp { bucket_cap 1 MiB }\n",
        "conflict",
        "a pipeline's ddp block cannot take bucket_cap",
        "bucket_cap",
        "a pipeline stage's buckets are all-reduced once a step, after its last backward, "
        "while the rank runs on (overlap on, no_sync on)",
        id="conflict-pipeline-ddp-bucket-cap",
    ),
    pytest.param(
        PP + "ddp { overlap off }\n",
        "conflict",
        "a pipeline's ddp block cannot take overlap off",
        "overlap",
        "after its last backward",
        id="conflict-pipeline-ddp-overlap-off",
    ),
    pytest.param(
        PP + "ddp { no_sync off }\n",
        "conflict",
        "a pipeline's ddp block cannot take no_sync off",
        "no_sync",
        "once a step",
        id="conflict-pipeline-ddp-no-sync-off",
    ),
    pytest.param(
        PP + "fsdp { unit tied = wte.weight  unit a = wpe.weight, h.0 .. h.1, head }\n",
        "conflict",
        "unit 'a' spans stages 's0' and 's1': a pipeline shards each stage's parameters "
        "over its own replicas",
        "unit a = wpe.weight, h.0 .. h.1, head",
        "split the unit where the stages meet",
        id="conflict-pipeline-unit-across-stages",
    ),
    pytest.param(
        PP + "fsdp { unit a = embed, h.0  unit b = h.1, head }\n",
        "conflict",
        "unit 'a' holds wte.weight with other parameters; in a pipeline the tied weight is "
        "a unit of its own",
        "unit a = embed, h.0",
        "`unit tied = wte.weight`: the head's stage keeps a copy of it, sharded the same "
        "way, so the two copies' shards match",
        id="conflict-pipeline-tied-unit",
    ),
    pytest.param(
        PP + "fsdp { prefetch forward 2 }\n",
        "conflict",
        "a pipeline's fsdp block cannot take prefetch",
        "prefetch",
        "a pipeline stage's units are gathered once a step, before its first forward, and "
        "kept until its last backward (reshard_after_forward off, as torchtitan under PP)",
        id="conflict-pipeline-fsdp-prefetch",
    ),
    pytest.param(
        PP.replace("world 2", "world 3")
        .replace("batch 8", "batch 12")
        .replace("schedule 1f1b", "schedule 1f1b\n  degree 2"),
        "mesh-size",
        "degree 2 does not divide world 3: the ranks are degree x dp, whole pipelines",
        "degree 2",
        "for world 3, degree 1, 3",
        id="mesh-size-pipeline-degree",
    ),
    pytest.param(
        PP.replace("world 2", "world 4 mesh 2 x 2").replace(
            "schedule 1f1b", "schedule 1f1b\n  degree 2"
        )
        + "fsdp { }\n",
        "mesh-size",
        "mesh 2 x 2 is 4 ranks, but a stage's replicas are dp = world 4 / degree 2 = 2",
        "mesh 2 x 2",
        "replicate x shard must multiply to dp; for dp 2: 2 x 1, 1 x 2",
        id="mesh-size-pipeline-hsdp",
    ),
    pytest.param(
        PP.replace("world 2", "world 8 mesh 2 x 2")
        .replace("batch 8", "batch 16")
        .replace("schedule 1f1b", "schedule 1f1b\n  degree 2"),
        "mesh-ddp",
        "a pipeline without an fsdp block replicates each stage over its 4 dp ranks and shards "
        "nothing: it takes no mesh 2 x 2",
        "mesh 2 x 2",
        "add `fsdp { }` to shard each stage's units over 2 ranks and all-reduce their gradient "
        "shards over 2, or drop the mesh",
        id="mesh-ddp-pipeline",
    ),
    pytest.param(
        PP.replace("micro 2", "accumulate 4").replace(
            "schedule 1f1b", "schedule 1f1b\n  microbatches 4"
        ),
        "conflict",
        "accumulate and the pipeline's microbatches both count the micro-batches",
        "microbatches 4",
        "keep one",
        id="conflict-pipeline-accumulate",
    ),
    pytest.param(
        PP.replace("schedule 1f1b", "schedule 1f1b\n  placment loop"),
        "unknown-setting",
        "a pipeline block has no 'placment'",
        "placment",
        "did you mean 'placement'?",
        id="unknown-setting-pipeline",
    ),
    pytest.param(
        PP.replace("1f1b", "1f1c"),
        "unknown-name",
        "unknown pipeline schedule '1f1c'",
        "1f1c",
        "did you mean '1f1b'?",
        id="unknown-name-pipeline-schedule",
    ),
    pytest.param(
        PP.replace("  schedule 1f1b\n", ""),
        "missing-setting",
        "the pipeline block names no schedule",
        "pipeline",
        "add `schedule 1f1b`",
        id="missing-setting-pipeline-schedule",
    ),
    pytest.param(
        PP.replace("stage s1", "stage s0"),
        "duplicate",
        "stage 's0' is defined twice",
        "s0",
        "give each stage its own name",
        id="duplicate-stage",
    ),
    # written pipeline programs: what the text means (lang/resolve/pipeline_programs.py)
    pytest.param(
        PP_WRITTEN.replace("B[s0]@mb0 RECV_B", "BWD[s0]@mb0 RECV_B"),
        "syntax",
        "unknown pipeline action 'BWD' in BWD[s0]@mb0",
        "BWD[s0]@mb0",
        "F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B",
        id="syntax-pp-action",
    ),
    pytest.param(
        PP_WRITTEN.replace(" F[s1]@mb1 B[s1]@mb1", " fwd[h.1]@mb1 B[s1]@mb1"),
        "syntax",
        "unknown pipeline action 'fwd'",
        "fwd[h.1]@mb1",
        "a pipeline program runs stages, not layers",
        id="syntax-pp-layer-op",
    ),
    pytest.param(
        PP_WRITTEN.replace("{ F[s0]@mb0", "{ F[s0]@mb0:c1"),
        "syntax",
        "F[s0]@mb0 is compute and runs on no communicator",
        "F[s0]@mb0:c1",
        "drop ':c1'",
        id="syntax-pp-compute-comm",
    ),
    pytest.param(
        PP_WRITTEN.replace("SEND_F[s0]@mb1+RECV_B[s0]@mb0 B[s0]@mb0", "SEND_F[s0]@mb1+B[s0]@mb0"),
        "syntax",
        "B[s0]@mb0 is compute, in a group joined by '+'",
        "B[s0]@mb0",
        "as an item of its own",
        id="syntax-pp-group",
    ),
    pytest.param(
        PP_WRITTEN.replace("{ F[s0]@mb0", "{ F[s0]"),
        "syntax",
        "F[s0] names no micro-batch as @mbN",
        "F[s0]",
        "write F[s0]@mb0",
        id="syntax-pp-no-mb",
    ),
    pytest.param(
        PP_WRITTEN.replace("{ F[s0]@mb0", "{ F[s0]@mb" + "9" * 30),
        "value-range",
        "micro-batch 999999999999... in F[s0]@mb... is beyond any pipeline's",
        "F[s0]@mb" + "9" * 30,
        None,
        id="value-range-pp-mb",
    ),
    pytest.param(
        PP_WRITTEN.replace("{ F[s0]@mb0", "{ F[S0]@mb0"),
        "unknown-name",
        "unknown stage 'S0' in F[S0]@mb0",
        "F[S0]@mb0",
        "did you mean 's0'?",
        id="unknown-name-pp-stage",
    ),
    pytest.param(
        PP_WRITTEN.replace("program on rank 1", "program on rank 2"),
        "value-range",
        "a pipeline rank must be <= 1, got 2",
        "2",
        None,
        id="value-range-pp-rank",
    ),
    pytest.param(
        PP_WRITTEN.replace("program on rank 1", "program on rank 0"),
        "duplicate",
        "the program of pipeline rank 0 is given twice",
        "program",
        "keep one of them",
        id="duplicate-pp-program",
    ),
    pytest.param(
        PP_WRITTEN.replace("  program on rank 1 {", "  # program on rank 1 {"),
        "missing-setting",
        "pipeline rank 1 has no program: the pipeline runs on 2 ranks",
        "pipeline",
        "write `program on rank 1 { ... }`",
        id="missing-setting-pp-program",
    ),
    pytest.param(
        PP_WRITTEN.replace("  program on rank 0", "  schedule 1f1b\n  program on rank 0"),
        "conflict",
        "the pipeline runs the named schedule '1f1b' and written programs",
        "program",
        "keep one",
        id="conflict-pp-schedule-and-programs",
    ),
    pytest.param(
        PP.replace("schedule 1f1b", "schedule written"),
        "missing-setting",
        "`schedule written`, but the pipeline block writes no program",
        "schedule written",
        "write every rank's program",
        id="missing-setting-pp-written",
    ),
    pytest.param(
        PP_WRITTEN.replace("stage s1 = h.1, head", "stage s1 = h.1\n  stage s2 = head"),
        "stage-count",
        "3 stages do not divide over the pipeline's 2 ranks",
        "pipeline",
        "declare 2 or 4 stages",
        id="stage-count-pp-written",
    ),
    pytest.param(
        PP + "program compute on rank 0 { fwd[h.0]@mb0 }\n",
        "conflict",
        "a pipeline schedule cannot take a stream's program yet",
        "program",
        "written inside the pipeline block",
        id="conflict-pipeline-stream-program",
    ),
    # written pipeline programs: the proofs (passes/pipeline_check.py), at the item
    pytest.param(
        PP_WRITTEN.replace("F[s0]@mb1 SEND_F", "F[s0]@mb2 SEND_F"),
        "pp-placement",
        "rank 0 runs F[s0]@mb2: micro-batch 2 does not exist (2 micro-batches)",
        "F[s0]@mb2",
        "the micro-batches are mb0 .. mb1",
        id="pp-placement",
    ),
    pytest.param(
        PP_WRITTEN.replace("RECV_B[s0]@mb1 B[s0]@mb1", "RECV_B[s0]@mb1 B[s0]@mb1 B[s0]@mb1"),
        "pp-once",
        "B[s0]@mb1 is issued 2 times",
        "B[s0]@mb1",
        None,
        id="pp-once",
    ),
    pytest.param(
        PP_WRITTEN.replace("F[s1]@mb1 B[s1]@mb1 SEND", "F[s1]@mb1 SEND"),
        "pp-once",
        "rank 1 never runs B[s1]@mb1",
        "program",
        None,
        id="pp-once-never",
    ),
    pytest.param(
        PP_WRITTEN.replace("RECV_B[s0]@mb1 B[s0]@mb1", "B[s0]@mb1 RECV_B[s0]@mb1"),
        "pp-order",
        "rank 0 runs B[s0]@mb1 (item 5) before RECV_B[s0]@mb1 (item 6), which it needs",
        "B[s0]@mb1",
        "move RECV_B[s0]@mb1 before B[s0]@mb1",
        id="pp-order",
    ),
    pytest.param(
        PP_WRITTEN.replace("SEND_B[s1]@mb1 }", "SEND_B[s1]@mb1:c1 }"),
        "pp-unmatched",
        "rank 0 issues RECV_B[s0]@mb1, and rank 1 never sends it",
        "RECV_B[s0]@mb1",
        "on the same communicator",
        id="pp-unmatched",
    ),
    pytest.param(
        PP_WRITTEN.replace(
            "RECV_F[s1]@mb0 F[s1]@mb0 RECV_F[s1]@mb1", "RECV_F[s1]@mb1 RECV_F[s1]@mb0 F[s1]@mb0"
        ),
        "pp-fifo",
        "FIFO inversion: rank 1's 1st receive from rank 0 on 'pp', RECV_F[s1]@mb1, pairs with "
        "rank 0's 1st send to it, SEND_F[s0]@mb0",
        "SEND_F[s0]@mb0",
        "post rank 1's receives from rank 0 in the order rank 0 sends",
        id="pp-fifo",
    ),
    pytest.param(  # the deferred receive of pytorch#172668
        PP_WRITTEN.replace("+RECV_B[s0]@mb0", " RECV_B[s0]@mb0").replace(
            "RECV_F[s1]@mb1 B[s1]@mb0 SEND_B[s1]@mb0", "B[s1]@mb0 SEND_B[s1]@mb0 RECV_F[s1]@mb1"
        ),
        "pp-deadlock",
        "deadlock: rank 1 blocks in SEND_B[s1]@mb0 until rank 0 posts RECV_B[s0]@mb0",
        "SEND_B[s1]@mb0",
        "post the receive before the send that waits on it",
        id="pp-deadlock",
    ),
]

WARN = [
    pytest.param(
        NANO + "ddp { bucket b1 = h.0  bucket b2 = head, h.1  bucket b3 = embed }",
        "bucket-order",
        "bucket 'b1' is complete after 'b2' but is listed first",
        "bucket b1 = h.0",
        "list buckets in reverse layer order",
        id="bucket-order",
    ),
    pytest.param(
        NANO + "ddp { bucket b1 = embed, h.0  bucket b2 = head, h.1 }",
        "tied-late",
        "bucket 'b1' holds wte.weight, whose gradient is complete only after bwd[embed]",
        "bucket b1 = embed, h.0",
        "move wte.weight to the last bucket",
        id="tied-late",
    ),
]


def compile_error(text: str) -> CompileError:
    with pytest.raises(CompileError) as info:
        compile_text(text, "t.sched")
    return info.value


def assert_diagnostic(d: Diagnostic, source: Source, message, underlined, hint) -> None:
    assert message in d.message
    if underlined is None:
        assert d.span is None
    else:
        assert source.snippet(d.span) == underlined
    if hint is None:
        assert d.hint is None
    else:
        assert hint in d.hint
    assert_rendered(d, source)


def assert_rendered(d: Diagnostic, source: Source) -> None:
    """mypy's header, the numbered source line, a caret under the span, vyper's hint."""
    lines = d.render(source).splitlines()
    sev = d.severity.value
    if d.span is None:
        assert lines[0] == f"t.sched: {sev}: {d.message}  [{d.code}]"
    else:
        s = d.span
        assert lines[0] == f"t.sched:{s.line}:{s.col}: {sev}: {d.message}  [{d.code}]"
        assert lines[1] == f"  {s.line} | {source.line_text(s.line)}"
        gutter, underline = lines[2].split(" | ", 1)
        assert gutter == " " * (2 + len(str(s.line)))
        assert underline.index("^") == s.col - 1
        # a span over several lines is underlined to the end of its first line
        end = s.end_col if s.end_line == s.line else len(source.line_text(s.line)) + 1
        width = end - s.col
        assert underline.strip() == "^" + "~" * (max(1, width) - 1)
    if d.hint:
        assert lines[-1] == f"  hint: {d.hint}"
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize("snippet, code, message, underlined, hint", FAIL)
def test_fail(snippet, code, message, underlined, hint):
    e = compile_error(snippet)
    errors = [d for d in e.diagnostics if d.is_error]
    assert {d.code for d in errors} == {code}, e.render()  # the case breaks this rule alone
    assert all(d.severity is Severity.ERROR for d in errors)
    assert_diagnostic(errors[0], e.source, message, underlined, hint)


@pytest.mark.parametrize("snippet, code, message, underlined, hint", WARN)
def test_warning(snippet, code, message, underlined, hint):
    c = compile_text(snippet, "t.sched")  # a warning does not stop the compile
    [d] = c.warnings
    assert d.code == code and d.severity is Severity.WARNING
    assert_diagnostic(d, c.source, message, underlined, hint)


# -- codes that come from outside a snippet -----------------------------------------------------


def test_io(tmp_path):
    with pytest.raises(CompileError) as info:
        read_source(tmp_path / "missing.sched")
    [d] = info.value.diagnostics
    assert d.code == "io" and "cannot read file: No such file or directory" in d.message
    assert d.path == str(tmp_path / "missing.sched") and d.span is None
    assert info.value.render() == f"{d.path}: error: {d.message}  [io]"


def test_file_too_large(tmp_path):
    big = tmp_path / "big.sched"
    big.write_text("# padding\n" * (MAX_SOURCE_BYTES // 10 + 1))
    with pytest.raises(CompileError) as info:
        read_source(big)
    [d] = info.value.diagnostics
    assert d.code == "file-too-large"
    assert f"file is {big.stat().st_size:,} bytes; a schedule is at most 1,048,576" in d.message
    assert "one training step in a page of text" in d.hint


@pytest.mark.parametrize(
    "data, message, col",
    [
        (b"model nano\nworld \xff\n", "byte 0xff at offset 17 is not UTF-8 text", 7),
        (b"model nano\x00", "NUL byte in source", 11),
    ],
    ids=["not-utf8", "nul"],
)
def test_encoding(data, message, col):
    with pytest.raises(CompileError) as info:
        source_from_bytes(data, "t.sched")
    [d] = info.value.diagnostics
    assert d.code == "encoding" and d.message == message
    assert (d.span.line, d.span.col) == (1 if col == 11 else 2, col)
    assert "is this a binary file?" in d.hint
    assert info.value.render().startswith(f"t.sched:{d.span.line}:{col}: error: {message}")


def test_an_encoding_error_shows_its_line_to_the_end():
    """The rest of the line after the bad byte is shown, undecodable bytes as U+FFFD."""
    with pytest.raises(CompileError) as info:
        source_from_bytes(b"model nano\nworld 1  # caf\xe9, saved as Latin-1\nsteps 2\n", "t.sched")
    lines = info.value.render().splitlines()
    assert lines[1:3] == ["  2 | world 1  # caf\ufffd, saved as Latin-1", "    |               ^"]


def test_disagree():
    one = compile_text("model nano\nworld 1\nbatch 8 x 32\nmicro 2\n", "one.sched").spec
    two = compile_text(DDP.replace("batch 8", "batch 16"), "two.sched").spec
    [d] = compare(one, two).diagnostics
    assert d.code == "disagree" and d.path == "two.sched"
    assert d.message == "the global batches differ: 16 x 32 here, 8 x 32 in one.sched"
    assert two.source.snippet(d.span) == "batch 16 x 32"
    assert "same sequences x tokens" in d.hint
    [note] = d.notes
    assert note.path == "one.sched" and one.source.snippet(note.span) == "batch 8 x 32"
    assert d.render(two.source).startswith(
        "two.sched:1:20: error: the global batches differ: 16 x 32 here, 8 x 32 in one.sched"
        "  [disagree]\n  1 | model nano world 2 batch 16 x 32 micro 2"
    )


# the tests just above; `proof`: only a wrong lowering makes one (tests/passes/test_proof.py)
OUTSIDE_SNIPPETS = {"io", "file-too-large", "encoding", "disagree", "proof"}


def test_every_code_has_a_case():
    covered = {p.values[1] for p in FAIL + WARN} | OUTSIDE_SNIPPETS
    assert covered == set(CODES)


def test_warnings_are_warnings_and_errors_errors():
    warned = {p.values[1] for p in WARN}
    assert warned == {"bucket-order", "tied-late"}
    assert not warned & {p.values[1] for p in FAIL}


# -- rendering and collection -------------------------------------------------------------------


def test_rendering_reads_like_a_compiler():
    e = compile_error(
        DDP + "program comm { allreduce[b1]@mb1 after bwd[head]@mb1  "
        "allreduce[b2]@mb1 after bwd[embed]@mb1 }"
    )
    assert (
        e.render()
        == """\
t.sched:3:16: error: allreduce[b1]@mb1 can start before bwd[h.1]@mb1 has written its gradients  [early-reduce]
  3 | program comm { allreduce[b1]@mb1 after bwd[head]@mb1  allreduce[b2]@mb1 after bwd[embed]@mb1 }
    |                ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  hint: write `allreduce[b1]@mb1 after bwd[h.1]@mb1`"""
    )  # noqa: E501


def test_notes_point_at_the_first_occurrence():
    e = compile_error("model nano\nworld 1\nworld 1\nbatch 8 x 32\nmicro 2")
    assert (
        e.render()
        == """\
t.sched:3:1: error: 'world' is given twice  [duplicate]
  3 | world 1
    | ^~~~~~~
t.sched:2:1: note: first given at line 2
  2 | world 1
    | ^~~~~~~
  hint: keep one of them"""
    )


def test_all_errors_are_collected_and_sorted_by_position():
    e = compile_error("model nano\nworld 0\nbatch 8 x 99999999\nmicro -2\nseed -1")
    assert [(d.code, d.span.line) for d in e.diagnostics] == [
        ("value-range", 2),
        ("value-range", 3),
        ("value-range", 4),
        ("value-range", 5),
    ]


def test_a_whole_file_diagnostic_has_no_caret():
    e = compile_error("")
    assert e.codes == ["missing-setting"] * 4
    assert (
        e.render().splitlines()[0] == "t.sched: error: the schedule has no 'batch'  "
        "[missing-setting]"
    )
