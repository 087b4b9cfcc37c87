"""What a run measures between steps (`eval { ... }`), as build-nanogpt measures it: the
validation loss, HellaSwag's `acc_norm` and samples from the model. All of it is outside the
step's plan and its proof: it reads the parameters after an update and changes none.

- Validation: the mean cross-entropy over M global batches of the `val` shards. Each rank
  reads the positions of each global batch its bound plan reads in training (ir/bound.py:
  together every sequence once), forwards them without autograd under the schedule's compute
  dtype, and the token-weighted sum is all-reduced in float64.
- HellaSwag: example i is scored by rank i % world (build-nanogpt's split); the counts of
  right predictions and of examples are all-reduced (model/hellaswag.py scores one).
- Samples: rank 0 continues the prompt with top-k 50 sampling from a generator seeded 42 +
  rank (build-nanogpt's loop; its rank 0's samples), and decodes them with GPT-2's tokenizer.

Each reads the model with every parameter (FullModel): under FSDP a copy gathered from the
shards, a collective every rank joins, even where only rank 0 samples; a pipeline's the same,
from its stages (exec/pipeline_eval.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from schedc.errors import RunError
from schedc.exec.failures import phase
from schedc.ir.spec import Strategy
from schedc.model.arch import GPT2_VOCAB
from schedc.model.data import GlobalBatches, gpt2_encoding
from schedc.model.gpt2 import GPT
from schedc.model.hellaswag import Example, most_likely
from schedc.model.reference import init_model

TOP_K = 50  # build-nanogpt's (and Hugging Face's pipeline default)
SAMPLE_SEED = 42  # build-nanogpt seeds each rank's generator 42 + rank


def due(every: int, step_index: int, steps: int) -> bool:
    """After every `every` steps and after the last (step_index: steps done; 0: never)."""
    return every > 0 and (step_index % every == 0 or step_index == steps)


class FullModel:
    """The model with every parameter, as evaluation reads it between steps. Under DDP it is
    the executor's own (every rank holds every parameter, updated in place); under FSDP a
    copy kept for the run, gathered from the shards at most once per step however many
    evaluations read it (the gather is a collective: every rank calls `get` the same times,
    as the step index it keys on is the same on every rank)."""

    def __init__(self, ex) -> None:  # an Executor, or exec/pipeline_eval.py's Evaluated
        self.ex = ex
        self._copy: GPT | None = None
        self._step = -1  # the step index the copy holds

    def get(self) -> GPT:
        ex = self.ex
        if ex.spec.kind is not Strategy.FSDP and ex.spec.pipeline is None:
            return ex.model
        if self._copy is None:
            self._copy = init_model(ex.spec.model, ex.spec.seed, ex.opts.dtype).to(ex.device)
        if self._step != ex.step_index:
            full = ex.full_tensors(grad=False)  # a collective: every rank gathers
            with torch.no_grad():
                for name, p in self._copy.named_parameters():
                    p.copy_(full[name])
            self._step = ex.step_index
        return self._copy


class Validation:
    """`loss()` after a step: the validation stream's mean loss, the same on every rank."""

    def __init__(self, full: FullModel, val: GlobalBatches, batches: int):
        self.full, self.ex, self.val, self.batches = full, full.ex, val, batches

    @torch.no_grad()
    def loss(self) -> float:
        ex = self.ex
        model = self.full.get()
        total = torch.zeros((), dtype=torch.float64, device=ex.device)
        for b in range(self.batches):
            for mb in range(ex.spec.accum):
                ids = ex.bound.positions(mb)
                if not ids:  # a pipeline rank past the first stage reads none
                    continue
                x, y = self.val.rows(b, ids)
                with ex.autocast_forward():
                    _, loss = model(x.to(ex.device), y.to(ex.device))
                total += loss.double() * x.numel()
        if ex.comm.world > 1:
            dist.all_reduce(total, group=ex.comm.group)
        return total.item() / (self.batches * ex.spec.seqs * ex.spec.seq_len)


@dataclass(frozen=True)
class Score:
    """HellaSwag's counts over every rank's examples."""

    correct_norm: int  # right by the mean loss of the ending's tokens
    correct: int  # right by their summed loss
    total: int

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.total

    @property
    def acc(self) -> float:
        return self.correct / self.total


class HellaSwag:
    """`score()` after a step: this rank's share of the examples, the counts all-reduced.
    `picks` holds this rank's predictions of the last score, by example index: (by summed
    loss, by mean loss)."""

    def __init__(self, full: FullModel, examples: list[Example]):
        self.full, self.ex, self.examples = full, full.ex, examples
        self.picks: dict[int, tuple[int, int]] = {}

    @torch.no_grad()
    def score(self) -> Score:
        ex, comm = self.ex, self.ex.comm
        model = self.full.get()
        self.picks = {}
        counts = torch.zeros(3, dtype=torch.long, device=ex.device)
        for i in range(comm.rank, len(self.examples), comm.world):  # i % world == rank
            e = self.examples[i]
            tokens, mask = e.tokens.to(ex.device), e.mask.to(ex.device)
            with ex.autocast_forward():
                logits, _ = model(tokens)
            pick, pick_norm = most_likely(tokens, mask, logits)
            self.picks[i] = (pick, pick_norm)
            counts += torch.tensor([pick_norm == e.label, pick == e.label, 1], device=ex.device)
        if comm.world > 1:
            dist.all_reduce(counts, group=comm.group)
        right_norm, right, total = counts.tolist()
        return Score(right_norm, right, total)


class Samples:
    """`texts()` after a step: rank 0's completions of the prompt (none on other ranks)."""

    def __init__(self, full: FullModel, count: int, length: int, prompt: str):
        self.full, self.ex, self.count, self.length = full, full.ex, count, length
        self.enc = gpt2_encoding()
        self.prompt = self.enc.encode_ordinary(prompt)
        if len(self.prompt) >= length:
            raise RunError(
                f"sample_prompt is {len(self.prompt)} tokens, and sample_tokens ({length}) "
                "counts the prompt's: raise sample_tokens or shorten the prompt"
            )

    @torch.no_grad()
    def texts(self) -> list[str]:
        ex = self.ex
        model = self.full.get()  # every rank: under FSDP a collective
        if ex.comm.rank != 0:
            return []
        xgen = torch.tensor(self.prompt, device=ex.device).unsqueeze(0).repeat(self.count, 1)
        rng = torch.Generator(device=ex.device)
        rng.manual_seed(SAMPLE_SEED + ex.comm.rank)
        while xgen.size(1) < self.length:
            with ex.autocast_forward():
                logits, _ = model(xgen)  # (B, T, vocab)
            # the last position's; ids past GPT-2's (a vocabulary padded to 50304) cannot
            # be decoded, so they are not drawn
            probs = F.softmax(logits[:, -1, :GPT2_VOCAB].float(), dim=-1)  # (B, vocab)
            topk_probs, topk_indices = torch.topk(probs, TOP_K, dim=-1)  # (B, 50)
            ix = torch.multinomial(topk_probs, 1, generator=rng)  # (B, 1); need not sum to 1
            xgen = torch.cat((xgen, torch.gather(topk_indices, -1, ix)), dim=1)
        return [self.enc.decode(row) for row in xgen.tolist()]


class Evaluations:
    """What is due after a step, in this order: validation, HellaSwag, samples. Each finding
    is a record, as --log-json writes it: `{"step", "val_loss"}`, `{"step",
    "hellaswag_acc_norm", "hellaswag_acc", "hellaswag_correct_norm", "hellaswag_total"}`,
    `{"step", "sample", "text"}` (rank 0's only)."""

    def __init__(self, ex, val: GlobalBatches | None, hellaswag: list[Example] | None):
        # ex: exec/executor.py's Executor, or a pipeline rank's view (exec/pipeline_eval.py)
        cfg, full = ex.spec.evaluation, FullModel(ex)
        self.ex, self.cfg = ex, cfg
        self.validation = Validation(full, val, cfg.val_batches) if val is not None else None
        self.hellaswag = HellaSwag(full, hellaswag) if hellaswag else None
        self.samples = None
        if cfg.sample_every > 0:
            self.samples = Samples(full, cfg.sample_count, cfg.sample_tokens, cfg.sample_prompt)

    def after(self, step: int) -> Iterator[dict]:
        """The record of each evaluation due after `step` (the step just done), as it is
        made; `phase` says which runs, for a failure's message."""
        done, steps, cfg = self.ex.step_index, self.ex.spec.steps, self.cfg
        if self.validation and due(cfg.val_every, done, steps):
            phase.where = f"validation after step {step}"
            yield {"step": step, "val_loss": self.validation.loss()}
        if self.hellaswag and due(cfg.hellaswag_every, done, steps):
            phase.where = f"HellaSwag after step {step}"
            s = self.hellaswag.score()
            yield {
                "step": step,
                "hellaswag_acc_norm": s.acc_norm,
                "hellaswag_acc": s.acc,
                "hellaswag_correct_norm": s.correct_norm,
                "hellaswag_total": s.total,
            }
        if self.samples and due(cfg.sample_every, done, steps):
            phase.where = f"samples after step {step}"
            for i, text in enumerate(self.samples.texts()):
                yield {"step": step, "sample": i, "text": text}
