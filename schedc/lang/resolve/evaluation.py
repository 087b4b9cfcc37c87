"""What a run measures besides training, read by the `eval { ... }` table: the validation
loss (`val_every`, `val_batches`), samples (`sample_every`, `sample_count`, `sample_tokens`,
`sample_prompt`) and HellaSwag (`hellaswag`, `hellaswag_every`). Nothing here enters the
step's plan or its proof: evaluation reads the model between steps and changes no parameter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schedc.ir.source import Span
from schedc.lang.diagnostics import Diagnostic, Diagnostics
from schedc.lang.resolve.context import Context, flag_place
from schedc.lang.resolve.keyed import Keys, read_keyed
from schedc.lang.resolve.values import int_of, one_number
from schedc.lang.syntax import Evaluation, Field, Str
from schedc.model.arch import GPT2_VOCAB, GPTConfig
from schedc.model.config import DataConfig, EvalConfig


def _count(lo: int, hi: int = 1 << 30):
    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        num = one_number(diag, f)
        v = None if num is None else int_of(diag, num, f.key.text, lo, hi)
        return None if v is None else {f.key.text: v}

    return read


def _text(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """One quoted text that is not blank: a prompt, a path."""
    v = f.values[0] if len(f.values) == 1 else None
    if not isinstance(v, Str) or not v.text.strip():
        diag.error("value-range", f"'{f.key.text}' takes one quoted, non-empty text", f.span)
        return None
    return {f.key.text: v.text}


EVAL = Keys(
    "eval",
    "eval",
    {
        "val_every": _count(0),  # 0: never
        "val_batches": _count(1),
        "sample_every": _count(0),
        "sample_count": _count(1, 64),
        "sample_tokens": _count(1),  # at most the model's context: judged below
        "sample_prompt": _text,
        "hellaswag": _text,
        "hellaswag_every": _count(0),
    },
)

# the flags that override a key of the table (CLI flags > .sched file > defaults)
FLAGS = ("val_every", "sample_every", "hellaswag", "hellaswag_every")


def resolve_evaluation(cx: Context, data: DataConfig, model: GPTConfig | None) -> EvalConfig:
    """The file's `eval` values over the defaults, then the flags' over both. Validation
    reads the `val` shards, so it needs shards: a directory, a glob or a list. Samples and
    HellaSwag are GPT-2 token ids, so they need the model's vocabulary to hold them."""
    e = cx.single(Evaluation, "eval", "the evaluation settings")
    keyed = read_keyed(cx, e.fields, EVAL) if e is not None else None
    config = EvalConfig(**keyed.values) if keyed is not None else EvalConfig()
    spans = keyed.spans if keyed is not None else {}
    if config.val_every and not data.sharded and "val_every" in spans:
        cx.err(
            "value-range",
            f"validation reads the `val` shards, and {_named(data)} has none",
            spans["val_every"],
            hint='write `data "shards/"` (scripts/make_shards.py makes them), or val_every = 0',
        )
    # `run --val-every` is checked for shards when it runs; the others here, at the flag
    flags = {k: getattr(cx.ov, k) for k in FLAGS if getattr(cx.ov, k) is not None}
    config = replace(config, **flags)
    Findings(cx, spans, flags).judge(config, model)
    return config


class Findings:
    """What the settings cannot do together, said where each value came from: at the flag
    that set it (`schedc: --sample-every 5`), else at the file's field."""

    def __init__(self, cx: Context, spans: dict[str, Span], flags: dict[str, Any]):
        self.cx, self.spans, self.flags = cx, spans, flags

    def judge(self, config: EvalConfig, model: GPTConfig | None) -> None:
        if config.hellaswag is None and config.hellaswag_every > 0:
            if "hellaswag_every" in self.flags or "hellaswag_every" in self.spans:
                self.say(
                    "missing-setting",
                    "hellaswag_every scores nothing without a `hellaswag` file",
                    "hellaswag_every",
                    'add `hellaswag = "hellaswag_val.jsonl"` (or run --hellaswag FILE)',
                )
        if model is None:  # its mistake is reported by the model's pass
            return
        for key, on, what in (
            ("sample_every", config.sample_every > 0, "samples decode"),
            ("hellaswag", config.hellaswag_on, "HellaSwag scores"),
        ):
            if on and model.vocab_size < GPT2_VOCAB:
                self.say(
                    "conflict",
                    f"{what} GPT-2 token ids (tiktoken's gpt2: {GPT2_VOCAB:,}), and "
                    f"the model's vocabulary holds {model.vocab_size:,}",
                    key,
                    f"a GPT-2 size, or `model ... {{ vocab = {GPT2_VOCAB} }}`; the data path "
                    "folds ids into a small vocabulary, which would turn text into noise",
                )
        if config.sample_every > 0 and config.sample_tokens > model.block_size:
            self.say(
                "context-length",
                f"samples of {config.sample_tokens} tokens exceed the model's context of "
                f"{model.block_size}",
                "sample_tokens" if "sample_tokens" in self.spans else "sample_every",
                f"sample_tokens = {model.block_size} or fewer",
            )

    def say(self, code: str, msg: str, key: str, hint: str) -> None:
        if key in self.flags:
            flag = key.replace("_", "-")
            place = flag_place(flag, self.flags[key])
            self.cx.diag.extend([Diagnostic(code, msg, path=place, hint=hint)])
        else:
            self.cx.err(code, msg, self.spans.get(key), hint=hint)


def _named(data: DataConfig) -> str:
    return "the embedded corpus" if data.source == "corpus" else f'"{data.source}"'
