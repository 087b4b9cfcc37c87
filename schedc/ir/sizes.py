"""The sizes of what a plan allocates, in bytes, from the resolved schedule alone.

    padded(numel, D)         a unit's flat length: a multiple of its shard group's ranks
    unit_numel, bucket_numel the parameters of a unit or a bucket
    op_bytes(spec, op)       what one collective moves per rank, in its dtype
    weight_grad_stash(spec, layer)  what a split backward (I, then W) keeps between the two
    above_weights(spec, layer)      and what its I frees
    layer_acts(spec, layer)  what autograd saves for one layer and micro-step, and the
                             transients of its forward and backward

ir/effects.py says when each buffer lives; passes/memory.py adds them up along a plan.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.op import Kind, Op
from schedc.ir.spec import Dtype, Spec, Strategy, UnitSpec
from schedc.model.arch import FP32


def padded(numel: int, world: int) -> int:
    """A unit's flat length: numel rounded up to a multiple of the world size."""
    return -(-numel // world) * world


def unit_numel(spec: Spec, unit: UnitSpec) -> int:
    return sum(spec.model.param(p).numel for p in unit.params)


def bucket_numel(spec: Spec, name: str) -> int:
    b = next(b for b in spec.buckets if b.name == name)
    return sum(spec.model.param(p).numel for p in b.params)


def op_bytes(spec: Spec, op: Op) -> int:
    """Bytes one collective moves per rank (its input), for counting communication volume:
    an all-reduce its bucket in the reduce dtype, an all-gather the full unit in the gather
    dtype, a reduce-scatter the full unit's gradient in the reduce dtype."""
    num = spec.numerics
    if op.kind is Kind.ALLREDUCE and spec.kind is Strategy.DDP:
        return bucket_numel(spec, op.target) * num.reduce.nbytes
    if op.is_collective:
        u = next(u for u in spec.fsdp.units if u.name == op.target)
        S = spec.mesh.shard
        dtype = num.gather if op.kind is Kind.ALLGATHER else num.reduce
        full = padded(unit_numel(spec, u), S) * dtype.nbytes
        return full // S if op.kind is Kind.ALLREDUCE else full  # HSDP: the shard
    return 0


@dataclass(frozen=True)
class LayerActs:
    """Bytes one layer holds for one micro-step (see `layer_acts`)."""

    saved: int  # what autograd saves for its backward, its input included
    kept: int  # what a recomputing layer keeps instead: its input
    fwd: int  # transient on top while its forward runs
    bwd: int  # transient on top while its backward runs


def layer_acts(spec: Spec, layer: str) -> LayerActs:
    """What autograd saves for one layer of GPT-2 in one micro-step, in bytes, and the
    transients of its forward and backward (measured on the CPU heap, rounded up to whole
    tensors).

    N = micro x seq_len tokens, C = n_embd, H = n_head, V = vocab, fp32 compute unless
    said (the tensors autograd saves, read with saved_tensors_hooks on torch 2.13's CPU
    kernels; views of one storage count once). A recomputing layer keeps only its input
    during forward (a block: N C in the compute dtype's residual stream, fp32; embed:
    nothing beyond the batch; head: N C), and holds `saved` again from its recompute to
    its backward.
    """
    if layer == "embed":
        # the position indices, 8 T bytes (int64); the token ids are the batch's. Its
        # forward and backward each hold its output (or its gradient), N C
        N, C = spec.micro * spec.seq_len, spec.model.n_embd
        return LayerActs(8 * spec.seq_len, 0, N * C * FP32, N * C * FP32)
    if layer == "head" and spec.numerics.loss_chunk is not None:
        return _chunked_head_acts(spec, spec.numerics.loss_chunk)
    if layer == "head":
        return _head_acts(spec)
    return _block_acts(spec)


def _block_acts(spec: Spec) -> LayerActs:
    """Block h.i: 16 C + 4 + H per token, fp32: ln_1: its input x (C) and mean, rstd (1 + 1);
    c_attn: ln_1's output (C); scaled_dot_product_attention (the CPU flash kernel, chosen
    for causal attention without dropout in fp32 and bf16; CUDA's flash and efficient
    kernels save the same): q, k, v (views of c_attn's output, 3 C), its output (C, laid out
    (B, T, H, hs), so the transpose back is a view that attn.c_proj saves for free) and the
    log-sum-exp (H); ln_2: x + attn (C) and mean, rstd; c_fc: ln_2's output (C); GELU: c_fc's
    output (4 C); mlp.c_proj: GELU's output (4 C). The residual adds save nothing.

    bf16 autocast (`compute = bf16`) saves the bf16 copies its matmuls read: 14 C bf16 per
    token; the LayerNorms' inputs and statistics (2 C + 4) stay in the residual stream's
    dtype and the log-sum-exp (H) in fp32; and, where the weights are fp32, the bf16 casts
    of the block's weights (12 C^2 x 2 bytes, made again by every forward). Under FSDP's
    bf16 gather the weights and so the residual stream are bf16 themselves: nothing is
    cast, and the LayerNorms save bf16 (read with saved_tensors_hooks on torch 2.13).

    Transients: forward, the attention projection and MLP outputs before their residual adds
    (2 C); backward, the gradients of the 4 C hidden and its input (about 4 C + 4 C + 2 C).
    """
    cfg, N = spec.model, spec.micro * spec.seq_len
    C, H = cfg.n_embd, cfg.n_head
    c, s = spec.numerics.compute.nbytes, stream_bytes(spec)
    saved = N * (14 * C * c + (2 * C + 4) * s + H * FP32) + _weight_casts(spec, 12 * C * C)
    return LayerActs(saved, N * C * s, N * 2 * C * s, N * 10 * C * s)


def weight_grad_stash(spec: Spec, layer: str) -> int:
    """What a split backward's I keeps for its W beyond the saved tensors, in bytes for one
    micro-step: the gradient at the output of every op that reads the layer's weights, where
    the W starts (torch's stage_backward_input, exec/pipeline.py). A block: its four
    matmuls' outputs (c_attn 3 C, attn.c_proj C, c_fc 4 C, mlp.c_proj C, in the compute
    dtype) and its two LayerNorms' (2 C, in the stream's); the head: ln_f's (C) and the
    logits' (V, in the compute dtype). Embed: none (its stage is the first, whose I has no
    input to differentiate and whose W runs the whole backward). Measured on tiny_pp_zb's
    middle rank: 2 micro-batches between I and W held 11 C x 4 bytes a token each. The
    I frees what only the loss's side of the graph saved: `above_weights`."""
    if layer == "embed":
        return 0
    cfg, N = spec.model, spec.micro * spec.seq_len
    c, s = spec.numerics.compute.nbytes, stream_bytes(spec)
    if layer == "head":
        return N * (cfg.n_embd * s + cfg.vocab_size * c)
    return N * cfg.n_embd * (9 * c + 2 * s)


def above_weights(spec: Spec, layer: str) -> int:
    """Of `layer_acts(spec, layer).saved`, what no weight's gradient needs: the tensors saved
    above the last op that reads a weight, which a split backward's I frees (it lets go of
    the loss, and nothing the W starts from reaches them). The head: log_softmax's output
    (V x 4 bytes a token); a block: nothing (its last op before the residual add is
    mlp.c_proj's matmul)."""
    if layer != "head" or spec.numerics.loss_chunk is not None:
        return 0
    return spec.micro * spec.seq_len * spec.model.vocab_size * FP32


def stream_bytes(spec: Spec) -> int:
    """Bytes of one element of the residual stream between layers, and of the parameters the
    layers compute with: FSDP's gather dtype (its units' parameters are gathered in it, so
    embed's output is in it too), else fp32 (autocast casts on the fly; its outputs add
    into the fp32 stream)."""
    return spec.numerics.gather.nbytes if spec.sync is Strategy.FSDP else FP32


def _weight_casts(spec: Spec, numel: int) -> int:
    """What autocast's casts of `numel` weight elements hold: none unless the compute dtype
    is narrower than the weights the layers read."""
    c = spec.numerics.compute.nbytes
    return numel * c if c < stream_bytes(spec) else 0


def _head_acts(spec: Spec) -> LayerActs:
    """head: 2 C + 2 + V per token: ln_f's input and output, mean and rstd, and
    log_softmax's output (cross_entropy = log_softmax + nll_loss, which saves the targets:
    the batch's). The logits themselves are not saved. bf16: ln_f's input and statistics in
    the stream's dtype, its output cast to bf16 (C x 2) for the matmul, log_softmax's output
    in fp32 (autocast upcasts the logits for it) and, where the tied weight is fp32, its
    bf16 cast (V C x 2, once a micro-step, not per token).

    Transients: forward, the logits (V); backward, the gradient of log_softmax's output
    and of the logits (2 V) and of its input (C).
    """
    cfg, N = spec.model, spec.micro * spec.seq_len
    C, V = cfg.n_embd, cfg.vocab_size
    c, s = spec.numerics.compute.nbytes, stream_bytes(spec)
    saved = N * ((C + 2) * s + C * c + V * FP32) + _weight_casts(spec, V * C)
    return LayerActs(saved, N * C * s, N * V * c, N * (2 * V + C) * FP32)


def _chunked_head_acts(spec: Spec, chunk: int) -> LayerActs:
    """head, `loss chunk K` (model/gpt2.py ChunkedLinearCE, which makes the loss and its
    gradients in one pass over the logits): ln_f's input, mean and rstd (C + 2 fp32 per
    token) and the Function's two gradients, grad h (N C fp32) and grad weight (V C in the
    weight's dtype: fp32, or the gather dtype under FSDP), kept from forward to backward in
    place of h. No logits and no log_softmax output are kept. A recomputing head's first
    forward runs without autograd and makes no gradients; its recompute makes them.

    Transients, with K = min(chunk, N): forward holds ln_f's output h (N C) and one chunk's
    logits and log-softmax (2 K V fp32; the softmax and the logits' gradient are made in
    place of the log-softmax); bf16: K V bf16 logits, their fp32 copy and log-softmax, the
    bf16 gradient of the logits, the bf16 casts of h and the weight (N C + V C), a chunk's
    (V, C) bf16 part of the weight's gradient before it is added in fp32, grad h in bf16
    before its fp32 copy, and, when the weight is 16-bit itself (FSDP's bf16 gather), the
    fp32 sum of the weight's gradient before its cast. Backward only hands the kept
    gradients on: its transient is ln_f's gradient of its input (N C fp32).
    """
    cfg, N = spec.model, spec.micro * spec.seq_len
    C, V = cfg.n_embd, cfg.vocab_size
    c = spec.numerics.compute.nbytes
    K = min(chunk, N)
    w = spec.numerics.gather.nbytes if spec.kind is Strategy.FSDP else FP32
    saved = N * (2 * C + 2) * FP32 + V * C * w  # ln_f's, grad h, grad weight
    fwd = N * C * FP32 + 2 * K * V * FP32  # h, one chunk's logits and log-softmax
    if spec.numerics.compute is not Dtype.FP32:
        casts = (N * C + V * C) * c
        fwd = N * C * FP32 + K * V * (2 * c + 2 * FP32) + casts + V * C * c + N * C * c
        fwd += V * C * FP32 if w != FP32 else 0
    return LayerActs(saved, N * C * FP32, fwd, N * C * FP32)


def batches_bytes(spec: Spec) -> int:
    """The step's token batches: int64 ids and targets of every micro-step, live throughout."""
    return spec.accum * 2 * spec.micro * spec.seq_len * 8
