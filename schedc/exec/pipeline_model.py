"""The part of GPT-2 one pipeline rank holds: its stages' layers and nothing else; and the
job every rank trains (`PipeJob`: the model, its split into stages, data and optimizer).

    split_layers(cfg, stages) -> (("embed", "h.0"), ("h.1", "head"))   contiguous ranges
    RankModel(cfg, layers, seed).run(stage_layers, x, targets)         one stage's forward

Parameters keep the whole model's names (`wte.weight`, `h.3.attn.c_attn.weight`, ...) and
get the whole model's initial values: the rank draws every parameter from the seed's one
generator in the model's order (`schedc.model.gpt2.init_value`, the rule GPT.init_weights
uses) and keeps only its own, so it allocates its stages' tensors plus one draw at a time.

The tied embedding: the head reads `wte.weight` as its output matrix. A rank that holds the
head but not the embed holds its own copy of `wte.weight` (Megatron's "word embeddings in
the last stage"), equal to the first stage's at the start; exec/pipeline_sync.py sums the
two copies' gradients after each step's backward, so the copies stay equal through every
update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from schedc.model.arch import GPTConfig
from schedc.model.config import OptimConfig
from schedc.model.data import GlobalBatches
from schedc.model.gpt2 import Block, init_value


@dataclass(frozen=True)
class PipeJob:
    """What every pipeline rank trains: the model, its stages, the data and the optimizer."""

    model: GPTConfig
    split: tuple[tuple[str, ...], ...]
    """Layers of each stage, contiguous, embed .. head (`split_layers`)."""
    batches: GlobalBatches
    """The global batch of each step; micro-batch j is its j-th of m equal slices."""
    optim: OptimConfig
    steps: int
    """The run's steps (the learning-rate schedule's horizon)."""
    seed: int
    dtype: torch.dtype = torch.float32
    compute: torch.dtype | None = None  # the autocast dtype of forward; None: `dtype`
    gather: torch.dtype | None = None  # what FSDP units are gathered and computed in
    reduce: torch.dtype | None = None  # what gradients are all-reduced or reduce-scattered in
    weights: Mapping[str, torch.Tensor] | None = None
    """Step 0's weights by parameter name (--init hf:DIR, exec/hf.py); None: the seed's."""


def split_layers(cfg: GPTConfig, stages: int) -> tuple[tuple[str, ...], ...]:
    """embed .. head cut into `stages` contiguous ranges as evenly as the layers allow (the
    earlier stages take one more where they do not divide)."""
    layers = cfg.layers
    if not 1 <= stages <= len(layers):
        raise ValueError(f"{len(layers)} layers cannot make {stages} non-empty stages")
    size, extra = divmod(len(layers), stages)
    out, at = [], 0
    for s in range(stages):
        n = size + (s < extra)
        out.append(tuple(layers[at : at + n]))
        at += n
    return tuple(out)


def check_split(cfg: GPTConfig, split: Sequence[Sequence[str]]) -> None:
    """A split covers embed .. head once, in order, with no empty stage (ValueError if not)."""
    flat = [layer for stage in split for layer in stage]
    if any(not stage for stage in split) or tuple(flat) != cfg.layers:
        raise ValueError(
            f"a stage split must cut {cfg.layers[0]} .. {cfg.layers[-1]} into non-empty "
            f"contiguous ranges in order, got {[list(s) for s in split]}"
        )


class RankModel(nn.Module):
    """The layers of one rank's stages (any subset of embed, h.i, head), GPT's arithmetic."""

    def __init__(
        self,
        cfg: GPTConfig,
        layers: Iterable[str],
        seed: int,
        dtype: torch.dtype = torch.float32,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layers = frozenset(layers)
        unknown = self.layers - set(cfg.layers)
        if unknown:
            raise ValueError(f"no layers {sorted(unknown)} in a {cfg.n_layer}-layer model")
        # registration order is the model's: wte, wpe, h.*, ln_f
        if self.layers & {"embed", "head"}:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # the head's copy, if alone
        if "embed" in self.layers:
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        blocks = [i for i in range(cfg.n_layer) if f"h.{i}" in self.layers]
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in blocks})
        if "head" in self.layers:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
        self._init(seed, weights)
        self.to(dtype)

    @torch.no_grad()
    def _init(self, seed: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """The whole model's draws in its order, or `weights`' (by name); this rank keeps its
        own (the head's tied copy: wte.weight's)."""
        mine = dict(self.named_parameters())
        gen = torch.Generator().manual_seed(seed)
        for spec in self.config.params:
            if weights is not None:
                if spec.name in mine:
                    mine[spec.name].copy_(weights[spec.name])
                continue
            value = init_value(self.config, spec.name, spec.shape, gen)
            if spec.name in mine:
                mine[spec.name].copy_(value)

    @property
    def holds_tied_copy(self) -> bool:
        """Whether this rank's wte.weight is the head's copy of the first stage's."""
        return "head" in self.layers and "embed" not in self.layers

    def layer_params(self, layer: str) -> list[nn.Parameter]:
        """The parameters layer `layer` computes with, in the model's order (the head's
        include wte.weight, its output matrix)."""
        own = dict(self.named_parameters())
        return [own[spec.name] for spec in self.config.layer_params(layer)] + (
            [own["wte.weight"]] if layer == "head" else []
        )

    def run(
        self, layers: Sequence[str], x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One stage's forward: tokens (B, T) or activation (B, T, C) in; activation out, or
        the micro-batch's mean cross-entropy () when the stage ends with the head."""
        for name in layers:
            if name == "embed":
                pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)  # (T,)
                x = self.wte(x) + self.wpe(pos)  # (B, T, C)
            elif name == "head":
                assert targets is not None, "the last stage needs its micro-batch's targets"
                logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, vocab), tied wte
                x = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
            else:
                x = self.h[name[2:]](x)  # (B, T, C)
        return x
