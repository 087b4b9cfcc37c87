"""HellaSwag as build-nanogpt scores it (its hellaswag.py, "completion style"): each example's
context followed by each of its 4 endings, and the cross-entropy of the ending's tokens
alone. The ending of the lowest mean loss is the prediction behind `acc_norm`, the one of the
lowest summed loss the prediction behind `acc`.

The file is local, in HellaSwag's own .jsonl format (one object a line with `ctx`, `endings`
(4 texts) and `label` (0-3); other keys are ignored, as build-nanogpt ignores them). Nothing
is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from schedc.files import NotRegularFile, read_limited
from schedc.model.data import DataError, gpt2_encoding

MAX_BYTES = 256 << 20  # HellaSwag's val split is 11 MiB, its train split 47 MiB
ENDINGS = 4


@dataclass(frozen=True)
class Example:
    """One example rendered as build-nanogpt's render_example renders it."""

    tokens: torch.Tensor  # (4, T): context + " " + ending per row, 0 after a row's end
    mask: torch.Tensor  # (4, T): 1 over each row's ending tokens, 0 elsewhere
    label: int  # the index of the right ending


def render(ctx: str, endings: list[str], label: int) -> Example:
    """The context's tokens then each ending's, with " " before it (GPT-2's tokenizer joins a
    leading space to the word), each row padded with 0 to the longest."""
    enc = gpt2_encoding()
    ctx_tokens = enc.encode_ordinary(ctx)
    rows, masks = [], []
    for end in endings:
        end_tokens = enc.encode_ordinary(" " + end)
        rows.append(ctx_tokens + end_tokens)
        masks.append([0] * len(ctx_tokens) + [1] * len(end_tokens))
    width = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m)
    return Example(tokens, mask, label)


def most_likely(tokens: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """(by summed loss, by mean loss): the ending each picks, build-nanogpt's
    get_most_likely_row. The loss at position t is of token t+1, so the mask shifts by one:
    the first ending token is predicted from the context's last."""
    shift_logits = logits[..., :-1, :].float()  # (4, T-1, vocab)
    shift_tokens = tokens[..., 1:]  # (4, T-1)
    losses = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_tokens.reshape(-1), reduction="none"
    ).view(tokens.size(0), -1)  # (4, T-1)
    shift_mask = mask[..., 1:]
    sum_loss = (losses * shift_mask).sum(dim=1)  # (4,)
    avg_loss = sum_loss / shift_mask.sum(dim=1)
    return int(sum_loss.argmin()), int(avg_loss.argmin())


def read_hellaswag(path: str, block_size: int) -> tuple[list[Example], str]:
    """Every example of the file rendered, and a fingerprint of the file (ranks agree on it
    at start-up); a DataError naming the file and line for anything that is not an example
    or does not fit the model's context."""
    data = _read(Path(path))
    examples = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        ctx, endings, label = _fields(path, n, line)
        ex = render(ctx, endings, label)
        if ex.tokens.size(1) > block_size:
            raise DataError(
                f"{path}:{n}: the context and its longest ending are {ex.tokens.size(1)} "
                f"tokens, more than the model's context of {block_size}"
            )
        examples.append(ex)
    if not examples:
        raise DataError(f"{path}: holds no HellaSwag example")
    digest = hashlib.sha256(data).hexdigest()[:16]
    return examples, f"{len(examples)} examples, sha256 {digest}"


def _read(path: Path) -> bytes:
    try:
        data = read_limited(path, MAX_BYTES)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (HellaSwag is read, never downloaded)") from None
    except NotRegularFile as e:
        raise DataError(f"{path}: {e.strerror}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_BYTES:
        raise DataError(f"{path}: more than {MAX_BYTES >> 20} MiB, larger than HellaSwag")
    return data


def _fields(path: str, n: int, line: str) -> tuple[str, list[str], int]:
    """`ctx`, `endings` and `label` of one line, or a DataError saying what is wrong there."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e.msg})") from None
    ctx = obj.get("ctx") if isinstance(obj, dict) else None
    endings = obj.get("endings") if isinstance(obj, dict) else None
    label = obj.get("label") if isinstance(obj, dict) else None
    if not isinstance(ctx, str):
        raise DataError(f'{path}:{n}: no "ctx" text (HellaSwag\'s format: ctx, endings, label)')
    if not (
        isinstance(endings, list)
        and len(endings) == ENDINGS
        and all(isinstance(e, str) and e for e in endings)
    ):
        raise DataError(f'{path}:{n}: "endings" must be a list of {ENDINGS} non-empty texts')
    if isinstance(label, str) and label.isdigit():  # HellaSwag's own files write "3" or 3
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < ENDINGS:
        raise DataError(f'{path}:{n}: "label" must be 0-{ENDINGS - 1}, got {label!r}')
    return ctx, endings, label
