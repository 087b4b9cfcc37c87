"""Hugging Face's GPT-2 beside schedc's, without torch: `--init hf:DIR` parsed, a model
directory's config.json read and held to the schedule's model, the config.json an export
writes, and the one table of tensor names both directions read (exec/hf.py moves the tensors).

    schedc                      Hugging Face GPT2LMHeadModel
    wte.weight                  transformer.wte.weight (lm_head.weight: the same tensor, tied)
    h.0.attn.c_attn.weight      transformer.h.0.attn.c_attn.weight, transposed (Conv1D)
    ln_f.bias                   transformer.ln_f.bias

Hugging Face's Conv1D stores a linear layer's weight as (in, out) and nn.Linear as (out, in),
so a block's four matrices are transposed both ways, as nanoGPT's from_pretrained does. Keys
are read with or without the `transformer.` prefix (the original `gpt2` files have none); the
attention-mask buffers older transformers saved (`attn.bias`, `attn.masked_bias`) are not
weights and are skipped.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from schedc.errors import UserError
from schedc.files import file_kind, read_limited
from schedc.model.arch import GPT2_VOCAB, GPTConfig

SCHEME = "hf:"
CONFIG = "config.json"
SAFETENSORS, PICKLE = "model.safetensors", "pytorch_model.bin"
MAX_CONFIG_BYTES = 1 << 20
PREFIX = "transformer."
TIED = "lm_head.weight"  # wte.weight again: schedc stores it once
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = (".attn.bias", ".attn.masked_bias")
EOT_ID = GPT2_VOCAB - 1  # <|endoftext|>: GPT-2's bos and eos

# config.json's sizes and the GPTConfig field each must equal
SIZES = (
    ("n_layer", "n_layer"),
    ("n_head", "n_head"),
    ("n_embd", "n_embd"),
    ("vocab_size", "vocab_size"),
    ("n_positions", "block_size"),  # the rows of wpe
)
# what schedc's GPT-2 computes: (field, the values that compute it, transformers' default)
SAME_MATH: tuple[tuple[str, tuple[Any, ...], Any], ...] = (
    ("model_type", ("gpt2",), "gpt2"),
    ("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new"),
    ("layer_norm_epsilon", (1e-5,), 1e-5),
    ("tie_word_embeddings", (True,), True),
    ("scale_attn_weights", (True,), True),
    ("scale_attn_by_inverse_layer_idx", (False,), False),
    ("add_cross_attention", (False,), False),
)


class HFError(UserError):
    """A Hugging Face model directory that cannot be loaded into the schedule's model, or
    an export that cannot be written."""


def parse_init(value: str) -> Path:
    """The directory of `--init hf:DIR`."""
    if not value.startswith(SCHEME) or not value[len(SCHEME) :].strip():
        raise HFError(
            f"--init {value}: give hf:DIR, a local Hugging Face GPT-2 directory "
            "(config.json and model.safetensors or pytorch_model.bin)"
        )
    return Path(value[len(SCHEME) :])


def schedc_name(key: str) -> str | None:
    """The schedc parameter a Hugging Face tensor key holds (`lm_head.weight` for the tied
    head); None for a buffer that is no weight."""
    if key.endswith(BUFFERS):
        return None
    return key.removeprefix(PREFIX)


def hf_name(name: str) -> str:
    """A schedc parameter's key in GPT2LMHeadModel's state dict."""
    return PREFIX + name


def transposed(name: str) -> bool:
    """Whether Hugging Face stores the parameter transposed (a Conv1D weight)."""
    return name.endswith(TRANSPOSED)


def hf_shape(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transposed(name) else shape


# -- reading a model directory ------------------------------------------------------------------


def read_config(directory: Path) -> dict[str, Any]:
    """DIR/config.json, a JSON object; a missing directory or file is an HFError."""
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise HFError(f"--init hf:{directory}: {what}")
    path = directory / CONFIG
    try:
        raw = read_limited(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise HFError(
            f"--init hf:{directory}: no {CONFIG} (a directory as save_pretrained writes it)"
        ) from None
    except OSError as e:
        raise HFError(f"{path}: cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFError(f"{path}: over {MAX_CONFIG_BYTES} bytes, too large for a model config")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HFError(f"{path}: not valid JSON: {e}") from None
    if type(config) is not dict:
        raise HFError(f"{path}: not a JSON object")
    return config


def check_config(config: dict[str, Any], path: Path, model: GPTConfig, name: str) -> None:
    """config.json describes a GPT-2 of the schedule model's sizes that computes what schedc's
    does; the first difference is an HFError naming it."""
    hint = f"set them in the schedule's `model {name} {{ ... }}` or pick --model"
    for key, ours in SIZES:
        theirs = config.get(key, config.get("n_ctx")) if key == "n_positions" else config.get(key)
        want = getattr(model, ours)
        if theirs != want:
            got = "no " + key if theirs is None else f"{key} {theirs}"
            field = key if key == ours else f"{ours} ({key})"
            raise HFError(
                f"{path}: {got}, but the schedule's model ({name}) has {field} {want}; "
                f"--init needs a GPT-2 of the schedule's sizes: {hint}"
            )
    if config.get("n_inner") not in (None, 4 * model.n_embd):
        raise HFError(f"{path}: n_inner {config['n_inner']}; schedc's MLP is 4 x n_embd wide")
    for key, same, default in SAME_MATH:
        if config.get(key, default) not in same:
            raise HFError(
                f"{path}: {key} {config[key]!r}; schedc's GPT-2 computes "
                f"{' or '.join(map(repr, same))}"
            )


def weights_file(directory: Path, model: GPTConfig | None = None) -> Path:
    """The file of weights: model.safetensors, else pytorch_model.bin. A symbolic link is
    followed (Hugging Face's cache links snapshots/REV/model.safetensors to ../../blobs/SHA);
    what it names must be a regular file (never a FIFO, device or directory), and with
    `model`, no larger than a GPT-2 of the model can be: told by stat alone, before a byte
    is read or hashed (a sparse 32 GiB file costs nothing to make)."""
    for name in (SAFETENSORS, PICKLE):
        path = directory / name
        if os.path.lexists(path):
            check_weights(path, _stat(path), model)
            return path
    sharded = [p.name for p in sorted(directory.glob("*.index.json"))]
    if sharded:
        raise HFError(
            f"--init hf:{directory}: {sharded[0]} names sharded weights, which schedc does "
            f"not read; save them as one file (save_pretrained(..., max_shard_size='100GB'))"
        )
    raise HFError(f"--init hf:{directory}: neither {SAFETENSORS} nor {PICKLE} is there")


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)  # follows a link
    except FileNotFoundError:
        if not path.is_symlink():
            raise HFError(f"{path}: missing") from None
        target = os.readlink(path)
        raise HFError(f"{path}: a symbolic link to {target}, which is missing") from None
    except OSError as e:
        raise HFError(f"{path}: cannot be read: {e.strerror or e}") from None


def check_weights(path: Path, st: os.stat_result, model: GPTConfig | None) -> None:
    """A weights file's stat: a regular file, and with `model`, of a size the model can
    have."""
    if not stat.S_ISREG(st.st_mode):
        raise HFError(f"{path}: {file_kind(st.st_mode)}, not a regular file")
    if model is not None and st.st_size > max_weight_bytes(model):
        raise HFError(
            f"{path}: {st.st_size} bytes, more than a GPT-2 of the schedule's sizes holds "
            f"({max_weight_bytes(model)} at most)"
        )


def max_weight_bytes(model: GPTConfig) -> int:
    """The most bytes a weights file of this model can need: every parameter in float64, an
    untied head, the attention-mask buffers older transformers saved, and headers."""
    masks = model.n_layer * (model.block_size**2 + 1)
    return 8 * (model.numel + model.vocab_size * model.n_embd + masks) + (64 << 20)


# -- writing one --------------------------------------------------------------------------------


def export_config(model: GPTConfig, dtype: str) -> dict[str, Any]:
    """config.json for GPT2LMHeadModel.from_pretrained: the model's sizes and what schedc's
    GPT-2 computes (no dropout: schedc trains without it). bos and eos are GPT-2's
    <|endoftext|> where the vocabulary holds it, else null (transformers' default of 50256
    would point past a small vocabulary)."""
    eot = EOT_ID if model.vocab_size > EOT_ID else None
    sizes = {key: getattr(model, ours) for key, ours in SIZES}
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **sizes,
        "n_ctx": model.block_size,
        "n_inner": None,
        **{key: default for key, _, default in SAME_MATH if key != "model_type"},
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "dtype": dtype,
    }
