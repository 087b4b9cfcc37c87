"""A Llama-family model in torch, beside GPT-2 (issue #47's first step): RMSNorm, rotary
position embeddings, a SwiGLU MLP and grouped-query attention, with an untied or a tied head.

Its parameters carry Hugging Face's names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`), so a
`LlamaForCausalLM` state dict loads as it is, and its arithmetic is HF's, step for step, in
any dtype: RMSNorm and the rotary angles computed in float32 and cast back (as HF's and
Meta's reference do, for bf16's sake), attention through torch's scaled-dot-product kernel
(HF's `sdpa`), causal. tests/model/test_llama.py holds logits, gradients and an AdamW step
equal to `transformers.LlamaForCausalLM` built from a config with random weights.

    LlamaConfig(vocab=..., dim=..., layers=..., heads=..., kv_heads=..., hidden=...)
    Llama(cfg)(idx, targets) -> (logits (B, T, vocab), mean cross-entropy or None)

Not yet a schedule's model: the compiler's model description (model/arch.py) is GPT-2's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-family model (Hugging Face's LlamaConfig, by other names)."""

    vocab: int
    dim: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads: grouped-query attention where fewer than heads
    hidden: int  # intermediate_size, the SwiGLU MLP's width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tied: bool = False  # the head's matrix is the embedding's

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"{self.heads} heads must divide dim {self.dim}, and {self.kv_heads} kv heads "
                "must divide the heads"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # in float32 whatever the input's dtype, then back
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(cfg: LlamaConfig, T: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """cos and sin (T, head_dim) of the rotary angles of positions 0 .. T-1, in float32 then
    `dtype`; each frequency twice (the rotate-half layout)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    angles = torch.arange(T, dtype=torch.float)[:, None] * inv_freq[None, :]  # (T, d/2)
    emb = torch.cat((angles, angles), dim=-1).to(device)  # (T, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        hd = cfg.head_dim
        q = self.q_proj(x).view(B, T, cfg.heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, cfg.kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, cfg.kv_heads, hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = cfg.heads // cfg.kv_heads  # each kv head serves this many query heads
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.heads * hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One pre-norm decoder layer: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """`model.*`: the embedding, the layers and the final norm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:  # one tensor, named once (named_parameters lists model.embed_tokens)
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.model.embed_tokens(idx)  # (B, T, dim)
        cos, sin = rotary(self.cfg, idx.size(1), x.dtype, x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
