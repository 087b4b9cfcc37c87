"""schedc's Llama-family model (schedc/model/llama.py) against transformers.LlamaForCausalLM
built from a config with random weights: the same state dict loads as it is, and the logits,
the loss's gradients and one AdamW step agree to float64 rounding, with grouped-query and
multi-head attention, tied and untied heads."""

from __future__ import annotations

import pytest
import torch

from schedc.model.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

CASES = {  # (kv heads of 4, tied head)
    "gqa-untied": (2, False),
    "gqa-tied": (2, True),
    "mha-untied": (4, False),
}


def pair(kv_heads: int, tied: bool) -> tuple[Llama, torch.nn.Module]:
    """schedc's model and HF's, in float64, HF's random weights (norms perturbed too) in both."""
    cfg = LlamaConfig(
        vocab=96, dim=32, layers=2, heads=4, kv_heads=kv_heads, hidden=64, rope_theta=500000.0,
        norm_eps=1e-5, tied=tied,
    )  # fmt: skip
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=64,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = Llama(cfg).double()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and set(unexpected) <= {"lm_head.weight"} and (tied or not unexpected)
    return ours, hf


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (3, 17), generator=g)
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_gradients_are_hugging_faces(case):
    ours, hf = pair(*CASES[case])
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(
        n for n, _ in hf.named_parameters()
    )
    x, y = batch()
    logits, loss = ours(x, y)
    out = hf(input_ids=x, labels=None)
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 96), y.reshape(-1))
    assert torch.allclose(logits, out.logits, rtol=1e-12, atol=1e-12)
    assert loss is not None and abs(loss.item() - want.item()) < 1e-12
    loss.backward()
    want.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g, h = p.grad, theirs[name].grad
        assert g is not None and h is not None, name
        assert torch.allclose(g, h, rtol=1e-10, atol=1e-13), (name, (g - h).abs().max())


def test_one_adamw_step_is_hugging_faces():
    ours, hf = pair(2, False)
    x, y = batch()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, hf)]
    _, loss = ours(x, y)
    assert loss is not None
    loss.backward()
    hf_loss = torch.nn.functional.cross_entropy(
        hf(input_ids=x).logits.reshape(-1, 96), y.reshape(-1)
    )
    hf_loss.backward()
    for opt in opts:
        opt.step()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p, theirs[name], rtol=1e-12, atol=1e-13), name
