"""GPT-2 shapes by arithmetic: layers, parameters, bytes and FLOPs, without torch.

This is the one source of truth for what a layer holds. The checker sizes buckets and
units from it, the cost model times ops from it, and `schedc.model.gpt2` builds its modules
from the same table (a test asserts that torch's parameters match it exactly).

Layers are named as the DSL names them::

    embed      wte (vocab x C), wpe (block x C)
    h.0 ...    one transformer block each: 12 C^2 + 13 C parameters
    head       ln_f; lm_head is tied to wte, so head owns no matrix of its own

The tied weight is the one subtle fact: `wte` is used by the forward of `embed` *and*
of `head`, so it receives gradient twice in backward (first from head, last from embed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

GPT2_VOCAB = 50257  # tiktoken's gpt2 encoding: 50,000 merges + 256 bytes + <|endoftext|>
FP32 = 4  # bytes per fp32 element


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model."""

    n_layer: int = 12
    """Number of transformer blocks (layers h.0 .. h.{n_layer-1})."""
    n_head: int = 12
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 768
    """Width C of the residual stream."""
    block_size: int = 1024
    """Context length: the longest sequence the model accepts (rows of wpe)."""
    vocab_size: int = GPT2_VOCAB
    """Rows of wte. Below 50257 the data path folds GPT-2 token ids into range (id % vocab)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    # -- layers ------------------------------------------------------------------------

    @cached_property
    def layers(self) -> tuple[str, ...]:
        """Layer names in forward order: embed, h.0 .. h.{n-1}, head."""
        return ("embed", *(f"h.{i}" for i in range(self.n_layer)), "head")

    def layer_index(self, layer: str) -> int:
        return self.layers.index(layer)

    def layer_params(self, layer: str) -> tuple[ParamSpec, ...]:
        """The parameters a layer owns, in module registration order."""
        return _layer_params(self, layer)

    @cached_property
    def params(self) -> tuple[ParamSpec, ...]:
        """Every parameter of the model once, in forward layer order."""
        return tuple(p for layer in self.layers for p in self.layer_params(layer))

    @cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    def param(self, name: str) -> ParamSpec:
        return self._by_name[name]

    def flat_order(self, names) -> tuple[str, ...]:
        """An FSDP unit's parameters as its flat parameter lays them out: those AdamW decays
        first, then the rest, each in the order given (passes/bind.py binds it; exec/flat.py
        lays a unit out in the bound order)."""
        return tuple(n for n in names if self.param(n).decay) + tuple(
            n for n in names if not self.param(n).decay
        )

    # -- sizes -------------------------------------------------------------------------

    def layer_numel(self, layer: str) -> int:
        return sum(p.numel for p in self.layer_params(layer))

    def layer_bytes(self, layer: str, dtype_bytes: int = FP32) -> int:
        return self.layer_numel(layer) * dtype_bytes

    @cached_property
    def numel(self) -> int:
        """Total parameters, the tied wte/lm_head counted once."""
        return sum(p.numel for p in self.params)

    # -- who reads and writes each parameter ---------------------------------------------

    def users(self, param: str) -> tuple[str, ...]:
        """Layers whose forward reads the parameter, in forward order."""
        if param == "wte.weight":
            return ("embed", "head")
        return (self.param(param).layer,)

    def rereaders(self) -> frozenset[str]:
        """Layers whose forward reads a parameter that an earlier layer read too (the head,
        through the tied wte)."""
        return frozenset(u for p in self.params for u in self.users(p.name)[1:])

    def writers(self, param: str) -> tuple[str, ...]:
        """Layers whose backward writes the parameter's gradient, in backward order.

        The last entry is the backward after which the gradient is complete.
        """
        return tuple(reversed(self.users(param)))

    # -- FLOPs (for the cost model) ------------------------------------------------------

    def layer_fwd_flops(self, layer: str, tokens: int, seq_len: int) -> float:
        """Forward FLOPs of one layer for `tokens` tokens in sequences of `seq_len`."""
        C = self.n_embd
        if layer == "embed":
            return 2.0 * tokens * C  # two lookups and an add: memory-bound, nearly free
        if layer == "head":
            return 2.0 * tokens * C * self.vocab_size + 10.0 * tokens * C
        # matmuls: 2 * (12 C^2) per token; attention scores and weighted sum: 2 * 2 * T * C
        return 2.0 * tokens * 12 * C * C + 4.0 * tokens * seq_len * C

    def with_overrides(self, **changes: int) -> GPTConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name in the model, the layer that owns it, its shape."""

    name: str
    layer: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def decay(self) -> bool:
        """AdamW decays matrices (and embeddings), not biases or LayerNorm gains."""
        return len(self.shape) >= 2

    def nbytes(self, dtype_bytes: int = FP32) -> int:
        return self.numel * dtype_bytes


def _layer_params(cfg: GPTConfig, layer: str) -> tuple[ParamSpec, ...]:
    C = cfg.n_embd
    shapes: list[tuple[str, tuple[int, ...]]]
    if layer == "embed":
        shapes = [("wte.weight", (cfg.vocab_size, C)), ("wpe.weight", (cfg.block_size, C))]
    elif layer == "head":
        shapes = [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]  # lm_head.weight is wte.weight
    elif layer.startswith("h.") and layer[2:].isdigit() and int(layer[2:]) < cfg.n_layer:
        # nn.Linear stores weight as (out, in)
        shapes = [
            (f"{layer}.ln_1.weight", (C,)),
            (f"{layer}.ln_1.bias", (C,)),
            (f"{layer}.attn.c_attn.weight", (3 * C, C)),
            (f"{layer}.attn.c_attn.bias", (3 * C,)),
            (f"{layer}.attn.c_proj.weight", (C, C)),
            (f"{layer}.attn.c_proj.bias", (C,)),
            (f"{layer}.ln_2.weight", (C,)),
            (f"{layer}.ln_2.bias", (C,)),
            (f"{layer}.mlp.c_fc.weight", (4 * C, C)),
            (f"{layer}.mlp.c_fc.bias", (4 * C,)),
            (f"{layer}.mlp.c_proj.weight", (C, 4 * C)),
            (f"{layer}.mlp.c_proj.bias", (C,)),
        ]
    else:
        raise KeyError(f"no layer {layer!r} in a {cfg.n_layer}-layer model")
    return tuple(ParamSpec(name, layer, shape) for name, shape in shapes)


# Named sizes. The GPT-2 family matches OpenAI's checkpoints; the small ones are for CPUs:
# `nano` is the tests' workhorse (a step in milliseconds), `tiny` the README demo,
# `mini` the small model of the benchmarks.
SIZES: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "mini": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=4096),
    "nano": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=512),
}
