"""HellaSwag as build-nanogpt scores it (its hellaswag.py, "completion style"): each example's
context followed by each of its 4 endings, and the cross-entropy of the ending's tokens
alone. The ending of the lowest mean loss is the prediction behind `acc_norm`, the one of the
lowest summed loss the prediction behind `acc`.

The file is local, in HellaSwag's own .jsonl format (one object a line with `ctx`, `endings`
(4 texts) and `label` (0-3); other keys are ignored, as build-nanogpt ignores them). Nothing
is downloaded.

Every rank reads the whole file, so what it costs is bounded by what is kept: the file is
read a line at a time (each at most MAX_LINE bytes, split on "\n" alone, as JSON Lines is:
a JSON string may hold a raw U+2028), and an example keeps its token ids packed, 4 bytes a
token, its tensors built when it is scored. Anything on a line that is not an example, be
it nesting past what Python's JSON reader allows or a label of thousands of digits, is a
DataError naming the file and the line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F

from schedc.files import NotRegularFile, open_regular
from schedc.model.data import DataError, gpt2_encoding

# HellaSwag's val split is 11 MiB (10,042 examples), its train split 47 MiB; a line of
# either is a few hundred bytes, and one that fits a model's context is far below MAX_LINE
MAX_BYTES = 64 << 20
MAX_LINE = 1 << 20
ENDINGS = 4
_LABEL = re.compile(r"[0-9]{1,3}")  # ASCII: str.isdigit() also takes "²" and "٣"
_INT_DIGITS = 30  # a JSON number longer than this is no label, and is not converted


@dataclass(frozen=True, slots=True)
class Example:
    """One example as build-nanogpt's render_example renders it, kept packed: int32 lengths
    of the context and of the 4 endings, then their tokens. `tokens` and `mask` are built
    when asked for, so an example keeps ~4 bytes a token, not two (4, T) int64 tensors."""

    packed: bytes
    label: int  # the index of the right ending

    @property
    def width(self) -> int:
        """T: the context's tokens and its longest ending's."""
        lens = np.frombuffer(self.packed, dtype="<i4", count=1 + ENDINGS)
        return int(lens[0] + lens[1:].max())

    @property
    def tokens(self) -> torch.Tensor:
        """(4, T): context + " " + ending per row, 0 after a row's end."""
        return self._rows(mask=False)

    @property
    def mask(self) -> torch.Tensor:
        """(4, T): 1 over each row's ending tokens, 0 elsewhere."""
        return self._rows(mask=True)

    def _rows(self, mask: bool) -> torch.Tensor:
        ids = np.frombuffer(self.packed, dtype="<i4").astype(np.int64)
        n_ctx, ends = int(ids[0]), ids[1 : 1 + ENDINGS].tolist()
        out = np.zeros((ENDINGS, self.width), dtype=np.int64)
        at = 1 + ENDINGS + n_ctx  # the first ending's first token
        for i, n in enumerate(ends):
            if mask:
                out[i, n_ctx : n_ctx + n] = 1
            else:
                out[i, :n_ctx] = ids[1 + ENDINGS : 1 + ENDINGS + n_ctx]
                out[i, n_ctx : n_ctx + n] = ids[at : at + n]
            at += n
        return torch.from_numpy(out)


def render(ctx: str, endings: list[str], label: int) -> Example:
    """The context's tokens then each ending's, with " " before it (GPT-2's tokenizer joins a
    leading space to the word), each row padded with 0 to the longest."""
    enc = gpt2_encoding()
    ctx_tokens = enc.encode_ordinary(ctx)
    ends = [enc.encode_ordinary(" " + end) for end in endings]
    head = [len(ctx_tokens), *map(len, ends)]
    packed = np.fromiter(itertools.chain(head, ctx_tokens, *ends), dtype="<i4").tobytes()
    return Example(packed, label)


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
    examples = []
    digest = hashlib.sha256()
    read = 0
    with _open(Path(path)) as f:
        for n in itertools.count(1):
            raw = f.readline(MAX_LINE + 1)  # splits on b"\n" alone
            if not raw:
                break
            read += len(raw)
            digest.update(raw)
            if read > MAX_BYTES:
                raise DataError(f"{path}: more than {MAX_BYTES >> 20} MiB, larger than HellaSwag")
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise DataError(
                    f"{path}:{n}: longer than {MAX_LINE >> 10} KiB, longer than any HellaSwag "
                    "example (a line is one example)"
                )
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            ex = render(*_fields(path, n, line))
            if ex.width > block_size:
                raise DataError(
                    f"{path}:{n}: the context and its longest ending are {ex.width} "
                    f"tokens, more than the model's context of {block_size}"
                )
            examples.append(ex)
    if not examples:
        raise DataError(f"{path}: holds no HellaSwag example")
    return examples, f"{len(examples)} examples, sha256 {digest.hexdigest()[:16]}"


def _open(path: Path) -> BinaryIO:
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (HellaSwag is read, never downloaded)") from None
    except NotRegularFile as e:
        raise DataError(f"{path}: {e.strerror}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None


class _LongNumber:
    """A JSON integer of more digits than any label, never converted: int() of one of
    thousands of digits is quadratic, and past 4,300 digits a ValueError."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _json_int(text: str) -> int | _LongNumber:
    return int(text) if len(text) <= _INT_DIGITS else _LongNumber(text)


def _shown(value: object) -> str:
    """A value as a one-line message may quote it."""
    if isinstance(value, _LongNumber):
        return f"a number of {value.digits} digits"
    if isinstance(value, str) and len(value) > 20:
        return f"a text of {len(value)} characters"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(path: str, n: int, line: str) -> tuple[str, list[str], int]:
    """`ctx`, `endings` and `label` of one line, or a DataError saying what is wrong there."""
    try:
        obj = json.loads(line, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e.msg})") from None
    except RecursionError:  # the C reader's own bound: a HellaSwag line nests 2 deep
        raise DataError(
            f"{path}:{n}: not an example: nested more deeply than a JSON reader follows "
            "(HellaSwag's line is an object holding a list of texts)"
        ) from None
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
    if isinstance(label, str) and _LABEL.fullmatch(label):  # HellaSwag's files write "3" or 3
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < ENDINGS:
        raise DataError(f'{path}:{n}: "label" must be 0-{ENDINGS - 1}, got {_shown(label)}')
    return ctx, endings, label
