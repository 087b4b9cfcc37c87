"""Training settings shared by the compiler, the reference step and the executor (no torch).

Precedence, everywhere: command-line flags > the .sched file > the defaults written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePath


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and cosine decay, and global gradient-norm clipping."""

    lr: float = 6e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 6e-5
    """Floor of the cosine decay, reached at `decay_steps`."""
    warmup: int = 10
    """Linear warmup steps (step 0 runs at lr / warmup)."""
    decay_steps: int = 0
    """Length of the cosine decay in steps; 0 means the run's step count."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (dim >= 2)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.min_lr >= 0 and self.min_lr <= self.lr):
            raise ValueError("need 0 <= min_lr <= lr and lr > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("betas must lie in [0, 1)")
        if self.warmup < 0 or self.decay_steps < 0 or self.clip < 0 or self.weight_decay < 0:
            raise ValueError("warmup, decay_steps, clip and weight_decay must be >= 0")

    def horizon(self, total_steps: int) -> int:
        """The step the cosine decay reaches min_lr at: decay_steps, else the run's steps."""
        return self.decay_steps or total_steps

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warmup, cosine decay."""
        decay = self.horizon(total_steps)
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if step >= decay:
            return self.min_lr
        span = max(1, decay - self.warmup)
        ratio = (step - self.warmup) / span
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
        return self.min_lr + coeff * (self.lr - self.min_lr)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = "corpus"
    """'corpus' (the embedded default), a UTF-8 text file, a uint16 token file, or token
    shards: a directory (every .npy and .bin in it) or a glob (`"shards/*_train_*.npy"`)."""
    kind: str = "auto"
    """'text', 'tokens' or 'auto' (by suffix: .bin/.npy are tokens, anything else text;
    a directory, written with a trailing '/', or a glob is always tokens)."""
    also: tuple[str, ...] = ()
    """Token sources read after `source`, in the order written: `data "a.npy", "b.npy"`."""

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source, *self.also)

    @property
    def sharded(self) -> bool:
        """Token shards, which split into train and val by file name: a directory written
        as one ('dir/'), a glob, or a list. One file, token or text, is training data."""
        return self.kind == "tokens" and (bool(self.also) or is_shards(self.source))

    def resolved(self) -> DataConfig:
        """The source as it is read, whatever the spelling: 'auto' decided by the suffix, and
        the embedded corpus always kind 'text'. `data corpus` and no `data` line, or `data
        "f.txt"` and `data text "f.txt"`, resolve alike, so they agree and fingerprint alike."""
        if self.source == "corpus":
            return DataConfig("corpus", "text")
        if self.kind != "auto":
            return self
        tokens = (
            self.also
            or any(map(is_shards, self.sources))
            or all(
                PurePath(s).suffix.lower() in TOKEN_SUFFIXES
                for s in self.sources  # as data.py reads
            )
        )
        return DataConfig(self.source, "tokens" if tokens else "text", self.also)


def is_shards(source: str) -> bool:
    """Whether a source names several files: a directory written as one ('dir/') or a glob."""
    return source.endswith(("/", "\\")) or is_glob(source)


def is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


@dataclass(frozen=True)
class EvalConfig:
    """What a run measures besides training (`eval { ... }`): outside the step's proof, it
    changes no parameter."""

    val_every: int = 0
    """Validation loss after every this many steps and after the last (0: never); it reads
    the `val` shards (build-nanogpt: every 250 steps)."""
    val_batches: int = 20
    """Global batches of the validation stream it averages over (build-nanogpt: 20)."""
    sample_every: int = 0
    """Samples from rank 0 after every this many steps and after the last (0: never)."""
    sample_count: int = 4
    """Completions of the prompt each time (build-nanogpt: 4)."""
    sample_tokens: int = 32
    """Tokens in each completion, the prompt's included (build-nanogpt's max_length: 32)."""
    sample_prompt: str = "Hello, I'm a language model,"
    """What each completion continues (build-nanogpt's prompt)."""
    hellaswag: str | None = None
    """A local HellaSwag .jsonl (build-nanogpt's format), read from the working directory of
    `schedc run`; its `acc_norm` is scored when given. Nothing is downloaded."""
    hellaswag_every: int = 250
    """With `hellaswag`: score it after every this many steps and after the last (0: never;
    build-nanogpt: every 250 steps)."""

    @property
    def hellaswag_on(self) -> bool:
        return self.hellaswag is not None and self.hellaswag_every > 0


TOKEN_SUFFIXES = (".bin", ".npy")  # read as uint16 token ids when the data kind is auto
