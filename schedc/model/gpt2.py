"""GPT-2 in torch, nanoGPT-shaped, and cuttable at every layer boundary.

Parameter names and shapes are exactly `schedc.model.arch`'s (a test holds them equal for every
named size), so the compiler's buckets and units name real tensors. The executor runs
the model one layer at a time with `forward_layer` / `forward_range` and drives backward
itself; `forward` is the ordinary whole-model call the reference step uses.

    embed   idx (B, T) int64  -> x (B, T, C)     wte(idx) + wpe(pos)
    h.i     x (B, T, C)       -> x (B, T, C)     one pre-LayerNorm transformer block
    head    x (B, T, C), y    -> loss ()         ln_f, logits through the tied wte, mean CE

`lm_head.weight` *is* `wte.weight`: registered after `wte`, it never appears in
`named_parameters()`, and the tensor receives gradient from both `head` and `embed`.

With `loss_chunk` set (the schedule's `loss chunk N`), the head's loss is `chunked_loss`:
ln_f as before, then logits and cross-entropy a chunk of N tokens at a time, never the
whole (B*T, vocab) logits (Liger-Kernel's FusedLinearCrossEntropy, torchtune's chunked CE).

With `embed_into_grad` set (the executor sets it: its parameters' .grad are permanent views of
flat buffers), the token embedding's backward adds its rows straight into `wte.weight.grad`
(EmbeddingIntoGrad) instead of building a dense (vocab, C) gradient and adding that, and
under bf16 autocast the head's bf16 gradient of that weight is added into it without an
fp32 copy first (CastIntoGrad).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from schedc.model.arch import SIZES, GPTConfig

__all__ = [
    "GPT",
    "MLP",
    "SIZES",
    "Block",
    "CausalSelfAttention",
    "CastIntoGrad",
    "ChunkedLinearCE",
    "EmbeddingIntoGrad",
    "GPTConfig",
    "chunked_loss",
    "init_value",
]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT-2 with bias, no dropout, tied embeddings; initialised from `seed` (nanoGPT's init).

    Built under ``torch.device('meta')`` it allocates nothing and skips initialisation.
    """

    def __init__(
        self,
        config: GPTConfig,
        seed: int = 0,
        *,
        loss_chunk: int | None = None,
        embed_into_grad: bool = False,
        loss_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.config = config
        # Registration order is arch.py's parameter order; wte first so that the tied
        # weight is named wte.weight.
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.loss_chunk = loss_chunk  # tokens per chunk of the head's loss; None: all
        self.embed_into_grad = embed_into_grad  # wte's backward adds into .grad in place
        # the grad the head's loss receives in backward (the executor's 1/k); the chunked
        # head folds it into the gradients it makes in forward
        self.loss_scale = loss_scale
        if not self.wte.weight.is_meta:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """nanoGPT's init: N(0, 0.02) matrices, N(0, 0.02/sqrt(2L)) for the residual
        projections (c_proj), zero biases, unit LayerNorm gains.

        Draws go in parameter order from one CPU generator in fp32, so a seed gives the
        same values on every device, and a float64 model holds the fp32 values exactly.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            p.copy_(init_value(self.config, name, tuple(p.shape), gen))

    # -- whole model -------------------------------------------------------------------

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, given targets (B, T), the mean cross-entropy."""
        x = self._embed(idx)
        for block in self.h:
            x = block(x)
        logits = self._logits(x)
        return logits, None if targets is None else _cross_entropy(logits, targets)

    # -- one layer at a time (the executor's view) ---------------------------------------

    def forward_layer(
        self, name: str, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run layer `name` (see the module docstring); `head` without targets gives logits."""
        if name == "embed":
            return self._embed(x)
        if name == "head":
            if targets is not None and self.loss_chunk is not None:
                h, w = self.ln_f(x), self.lm_head.weight
                return chunked_loss(h, w, targets, self.loss_chunk, self.loss_scale)
            logits = self._logits(x)
            return logits if targets is None else _cross_entropy(logits, targets)
        return self.h[self._block_index(name)](x)

    def forward_range(
        self, first: str, last: str, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run layers `first` .. `last` inclusive, in forward order; the loss if `last` is head."""
        layers = self.config.layers
        i, j = self._layer_index(first), self._layer_index(last)
        if i > j:
            raise ValueError(f"layer range {first} .. {last} runs backwards")
        for name in layers[i : j + 1]:
            x = self.forward_layer(name, x, targets if name == "head" else None)
        return x

    def layer_parameters(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """The parameters layer `name` owns, in `GPTConfig.layer_params` order."""
        params = dict(self.named_parameters())
        return [(spec.name, params[spec.name]) for spec in self.config.layer_params(name)]

    # -- pieces ------------------------------------------------------------------------

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)  # idx: (B, T)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        if self.embed_into_grad and not torch.compiler.is_compiling():
            tok = EmbeddingIntoGrad.apply(idx, self.wte.weight)
        else:
            tok = self.wte(idx)
        return tok + self.wpe(pos)  # (B, T, C) + (T, C)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.ln_f(x), self.lm_head.weight
        dev = h.device.type
        if self.embed_into_grad and torch.is_autocast_enabled(dev):
            low = torch.get_autocast_dtype(dev)
            if w.dtype != low and not torch.compiler.is_compiling():
                # autocast's cast of the tied weight, made here so its backward adds in place
                return F.linear(h, CastIntoGrad.apply(w, low))
        return self.lm_head(h)  # (B, T, vocab), through the tied wte

    def _layer_index(self, name: str) -> int:
        if name not in self.config.layers:
            raise KeyError(f"no layer {name!r} in a {self.config.n_layer}-layer model")
        return self.config.layer_index(name)

    def _block_index(self, name: str) -> int:
        return self._layer_index(name) - 1  # layers are embed, h.0, h.1, ...


def init_value(
    config: GPTConfig, name: str, shape: tuple[int, ...], gen: torch.Generator
) -> torch.Tensor:
    """The initial value of parameter `name` (nanoGPT's init, see GPT.init_weights), drawn
    from `gen` in fp32 on the CPU; called in parameter order, as the draws follow each other.
    A pipeline rank calls it for every parameter and keeps only its stages' (exec/pipeline.py)."""
    if len(shape) >= 2:
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        std = proj_std if name.endswith("c_proj.weight") else 0.02
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    if name.endswith(".weight"):  # the only vectors named weight: LayerNorm gains
        return torch.ones(shape)
    return torch.zeros(shape)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B*T positions."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class EmbeddingIntoGrad(torch.autograd.Function):
    """weight[idx], whose backward adds each token's gradient row straight into weight.grad.

    An embedding's ordinary backward (embedding_dense_backward) fills a zero (vocab, C)
    buffer, adds the rows into it, and autograd then adds that whole buffer into .grad: for
    GPT-2's 50,257-row tied weight, two passes over 154 MB (gpt2) to place B*T rows. When
    .grad already exists in the weight's dtype (the executor's flat buffers: a DDP bucket,
    an FSDP unit's fp32 unsharded gradient) this backward index_adds the rows into it and
    returns no gradient for the weight, Megatron-LM's gradient-accumulation fusion for the
    one op where it matters on a CPU. The values differ from the dense path only in the
    order of fp32 additions (g + a + b instead of g + (0 + a + b)). Without such a .grad
    (none yet), or where the reordered sum would round in 16 bits (a bf16 .grad under a bf16
    gather), and on a GPU (where index_add_ is atomic, so its order of additions would vary from
    run to run, and the dense pass is cheap), it returns the dense gradient exactly as
    embedding's backward does.
    """

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        ctx.weight = weight  # a leaf parameter: no reference cycle through the graph
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        weight, rows = ctx.weight, grad.reshape(-1, grad.size(-1))
        into = weight.grad
        if (
            into is not None
            and into.dtype == grad.dtype
            and into.dtype.itemsize >= 4
            and into.device.type == "cpu"  # CUDA's index_add_ adds with atomics: unordered
        ):
            into.index_add_(0, idx.reshape(-1), rows)
            return None, None
        dense = torch.ops.aten.embedding_dense_backward(grad, idx, weight.size(0), -1, False)
        return None, dense.to(weight.dtype)


class CastIntoGrad(torch.autograd.Function):
    """weight.to(dtype) (autocast's cast of a weight), whose backward adds the 16-bit
    gradient straight into the weight's fp32 .grad: `grad.add_(g16)` upcasts inside the add,
    exactly as `grad.add_(g16.float())` does, without the (vocab, C) fp32 copy autocast's
    cast-back makes first. Used for the head's tied weight under bf16 compute when .grad is
    a flat buffer's view (`embed_into_grad`); otherwise it returns the upcast gradient."""

    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.weight = weight
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        into = weight.grad
        if into is not None and into.dtype.itemsize >= 4 and into.dtype == weight.dtype:
            into.add_(grad)
            return None, None
        return grad.to(weight.dtype), None


class ChunkedLinearCE(torch.autograd.Function):
    """mean cross-entropy of (h @ weight.T) against targets, `chunk` rows at a time, with its
    gradients made in the same pass (Liger-Kernel's FusedLinearCrossEntropy).

    h (N, C), weight (V, C), targets (N,) int64 -> loss () fp32, the same value as
    `F.cross_entropy(h @ weight.T, targets)` (mean over the N rows, no ignore_index).
    Each chunk's (chunk, V) logits live only while that chunk is handled: forward sums the
    chunk's loss and, from the same logits, forms (softmax - onehot) x scale / N, writes the
    chunk's rows of grad h and adds its part of grad weight. It keeps those two gradients
    (N C and V C) instead of h, so no logits are ever made twice; backward only hands them
    on. `scale` is the grad the loss will receive in backward (the executor's micro-step
    1/k): folded in before the matmuls, it gives the very arithmetic of the unchunked head's
    backward; should another grad arrive, backward multiplies the kept gradients by
    grad / scale (in place: a second backward through the same graph with yet another grad
    rescales what the first returned). A forward without autograd (torch.no_grad, a
    recomputing head's first forward) computes only the loss.

    Under autocast the arithmetic is autocast's for the unchunked head, done explicitly:
    h and the weight cast to the compute dtype, logits in it, cross-entropy in fp32, the
    logits' gradient rounded to the compute dtype for the two matmuls, grad h in it, and
    each chunk's part of grad weight added in fp32. The chunked sums of grad weight (over
    chunks instead of one matmul over all rows) are not bitwise the unchunked ones: they
    agree within fp32's rounding (tests/oracle.py).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, scale: float = 1.0, grads: bool = True):
        dev, N = h.device.type, h.size(0)
        low = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        want_h = grads and ctx.needs_input_grad[0]
        want_w = grads and ctx.needs_input_grad[1]
        wide = _wide(h).dtype  # the loss's dtype, and its gradient's
        ctx.scale = torch.full((), scale, dtype=wide, device=h.device)
        with torch.autocast(dev, enabled=False):
            hc, wc = _cast(h, low), _cast(weight, low)
            step = ctx.scale / N  # d loss x scale / d logits = (softmax - onehot) x step
            total = torch.zeros((), dtype=wide, device=h.device)
            grad_h = torch.empty_like(hc) if want_h else None
            grad_w = None  # the first chunk's matmul makes it (no zero-filled pass first)
            for s in range(0, N, chunk):
                rows, y = hc[s : s + chunk], targets[s : s + chunk]
                lsm = F.log_softmax(_wide(rows @ wc.t()), dim=-1)  # (chunk, V), fp32 at least
                total += F.nll_loss(lsm, y, reduction="sum")  # what cross_entropy sums
                if not (want_h or want_w):
                    continue
                d = lsm.exp_().mul_(step)  # softmax x step, in place of the log-softmax
                d[torch.arange(d.size(0), device=d.device), y] -= step
                d = _cast(d, low)
                if grad_h is not None:
                    torch.mm(d, wc, out=grad_h[s : s + chunk])
                if want_w:
                    if grad_w is None:
                        grad_w = _wide(d.t() @ rows)
                    elif d.dtype == grad_w.dtype:
                        grad_w.addmm_(d.t(), rows)  # in place: no (V, C) temporary a chunk
                    else:
                        grad_w += d.t() @ rows  # a 16-bit chunk's part, added in fp32
                del d, lsm
        ctx.grad_h = None if grad_h is None else grad_h.to(h.dtype)
        ctx.grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return total / N

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.grad_h, ctx.grad_w
        if grad_h is None and grad_w is None:
            raise RuntimeError("ChunkedLinearCE: backward of a forward run without autograd")
        grad = grad.to(ctx.scale.dtype)
        # the scale forward folded in is almost always the grad that arrives (the executor
        # passes it); compared on the host only on a CPU, where it costs no synchronisation
        if grad.device.type != "cpu" or not torch.equal(grad, ctx.scale):
            ratio = grad / ctx.scale
            for t in (grad_h, grad_w):
                if t is not None:
                    t.mul_(ratio.to(t.dtype))
            ctx.scale = grad
        return grad_h, grad_w, None, None, None, None


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 for the 16-bit dtypes (what autocast runs cross-entropy in); others as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def chunked_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, scale: float = 1.0
) -> torch.Tensor:
    """The head's mean cross-entropy from ln_f's output h (B, T, C), `chunk` tokens at a time;
    `scale`: the grad its backward will receive (see ChunkedLinearCE)."""
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    flat = h.reshape(-1, h.size(-1))
    return ChunkedLinearCE.apply(flat, weight, targets.reshape(-1), chunk, scale, grads)
