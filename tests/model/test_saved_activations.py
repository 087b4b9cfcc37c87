"""The ledger's activations are what autograd saves (schedc/ir/sizes.py `layer_acts`).

Each layer of GPT-2 runs forward under saved_tensors_hooks; the bytes of the distinct
storages it saves (parameters and their views excluded, the batch's token ids too: the
ledger counts the batch once) must equal `layer_acts(...).saved`, in fp32, for two shapes.
"""

from __future__ import annotations

import pytest
import torch

from schedc.compiler import compile_text
from schedc.ir.sizes import layer_acts
from schedc.model.gpt2 import GPT


def saved_bytes(model, layer, x, y, exclude) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.forward_layer(layer, x, y if layer == "head" else None)
    return out, sum(n for p, n in seen.items() if p not in exclude)


@pytest.mark.parametrize(
    "text", ["model tiny world 1 batch 4 x 64 micro 2", "model nano world 1 batch 3 x 32 micro 3"]
)
def test_layer_acts_are_what_autograd_saves(text):
    spec = compile_text(text).spec
    model = GPT(spec.model, 0)
    B, T = spec.micro, spec.seq_len
    idx = torch.randint(0, spec.model.vocab_size, (B, T))
    y = torch.randint(0, spec.model.vocab_size, (B, T))
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {idx.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    x = idx
    for layer in spec.model.layers:
        inp = x if layer == "embed" else x.detach().requires_grad_()
        x, got = saved_bytes(model, layer, inp, y, exclude)
        want = layer_acts(spec, layer).saved
        # the head's loss is a 0-d tensor (4 bytes), and targets flattened as a view
        assert abs(got - want) <= 16, (layer, got, want)
