"""Text -> Lark parse tree, with Lark's errors turned into located diagnostics.

The grammar is grammar/schedc.lark (see schedc.lang.resources for where it is found). The
parser is LALR with the contextual lexer and propagated positions; it is built once per
process.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from schedc.ir.source import Source, Span
from schedc.lang.diagnostics import CompileError, Diagnostic, did_you_mean
from schedc.lang.resources import grammar_path

# A schedule is a page of text: the bundled ones hold under 200 tokens, and a program written
# out for a hundred micro-steps a few thousand. The limit bounds the parse tree a file under
# MAX_SOURCE_BYTES can make: a megabyte of `x, ` is 350,000 names, whose tree, AST and
# diagnostics take 8 s and 600 MB unbounded, before anything can say they are one mistake.
MAX_TOKENS = 50_000


class _TooManyTokens(Exception):
    def __init__(self, token: Token):
        self.token = token


class _TokenLimit:
    """A Lark post-lexer that passes tokens through and stops the parse past MAX_TOKENS."""

    always_accept = ()

    def process(self, stream):
        for n, tok in enumerate(stream, 1):
            if n > MAX_TOKENS:
                raise _TooManyTokens(tok)
            yield tok


@lru_cache(maxsize=1)
def parser() -> Lark:
    return Lark.open(
        str(grammar_path()),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=False,
        postlex=_TokenLimit(),
    )


def parse(source: Source) -> Tree:
    """Parse a whole file; raises CompileError with one [syntax]/[unclosed]/[file-too-large]
    diagnostic."""
    try:
        return parser().parse(source.text)
    except UnexpectedInput as e:
        raise CompileError([_diagnose(e, source)], source) from None
    except _TooManyTokens as e:
        raise CompileError(
            [
                Diagnostic(
                    "file-too-large",
                    f"the schedule has more than {MAX_TOKENS:,} tokens (names, numbers, ops, "
                    "signs); "
                    "this is the first past the limit",
                    span=_token_span(e.token, source),
                    hint="a .sched file describes one training step in a page of text",
                )
            ],
            source,
        ) from None


# -- error mapping ----------------------------------------------------------------------------

# How expected terminals read in a message; anonymous keywords read as themselves.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": 'a "quoted path"',
    "UNIT": "a unit (B, KiB, MiB, GiB)",
    "OP": "an op (like bwd[h.0]@mb0)",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "EQUAL": "'='",
    "COMMA": "','",
    "$END": "end of file",
}


def _keyword(terminal: str) -> str | None:
    """The literal text of an anonymous keyword terminal, or None."""
    for t in parser().terminals:
        if t.name == terminal and t.pattern.type == "str":
            return t.pattern.value
    return None


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[terminal]
    kw = _keyword(terminal)
    return f"'{kw}'" if kw is not None else terminal.lower()


def _expected_list(expected: set[str]) -> str:
    # kinds of token first ("a number"), then keywords: a long list is cut after 8
    words = sorted(
        {_describe(t) for t in expected if t not in {"COMMENT", "WS"}},
        key=lambda w: (w.startswith("'"), w),
    )
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


def _accepted(e: UnexpectedInput) -> set[str]:
    """The terminals the parser can take where it stopped.

    Asked of the parser state itself: LALR merges the lookaheads of states that share a
    rule (`size` in `memory` and `bucket_cap`, `refs` in buckets and units), so the
    exception's own `expected` set lists keywords that are not legal at this point.
    """
    ip = getattr(e, "interactive_parser", None)
    if ip is not None:
        return set(ip.accepts())
    return set(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())


def _diagnose(e: UnexpectedInput, source: Source) -> Diagnostic:
    if isinstance(e, UnexpectedToken) and e.token.type == "$END" or isinstance(e, UnexpectedEOF):
        opened = _unclosed_brace(source)
        if opened is not None:
            return Diagnostic(
                "unclosed",
                "this '{' is never closed",
                span=source.span(opened, opened + 1),
                hint="add '}' at the end of the block",
            )
        end = len(source.text.rstrip())  # just after the last thing written
        return Diagnostic(
            "syntax",
            "unexpected end of file",
            span=source.span(end, end),
            hint=f"expected {_expected_list(_accepted(e))}",
        )
    if isinstance(e, UnexpectedToken):
        tok: Token = e.token
        span = _token_span(tok, source)
        expected = _accepted(e)
        keywords = [k for k in (_keyword(t) for t in expected) if k and k.isidentifier()]
        hint = None
        if tok.type in ("NAME", "OP") or (tok.value.isidentifier() and keywords):
            hint = did_you_mean(str(tok.value), keywords)
        if hint is None:
            hint = f"expected {_expected_list(expected)}"
        what = "end of file" if tok.type == "$END" else f"'{_clip(tok.value)}'"
        return Diagnostic("syntax", f"unexpected {what}", span=span, hint=hint)
    if isinstance(e, UnexpectedCharacters):
        # lark declares pos_in_stream None on UnexpectedInput; UnexpectedCharacters sets it
        # to the int offset where lexing stopped
        pos: int = e.pos_in_stream  # type: ignore[assignment]
        ch = source.text[pos] if pos < len(source.text) else ""
        word = _word_at(source.text, pos)
        allowed = _accepted(e)
        keywords = [k for k in (_keyword(t) for t in allowed) if k and k.isidentifier()]
        hint = did_you_mean(word, keywords) if word else None
        if hint is None and allowed:
            hint = f"expected {_expected_list(allowed)}"
        span = source.span(pos, pos + max(1, len(word)))
        if ch.isdecimal() and not ch.isascii():  # '２', '٣': a digit, but not one of 0-9
            name = unicodedata.name(ch, f"U+{ord(ch):04X}").lower()
            return Diagnostic(
                "syntax",
                f"'{ch}' ({name}) is not a digit schedc reads",
                span=source.span(pos, pos + 1),
                hint="write numbers with the ASCII digits 0-9",
            )
        shown = _clip(word) if word else repr(ch)[1:-1]
        return Diagnostic("syntax", f"unexpected '{shown}'", span=span, hint=hint)
    return Diagnostic("syntax", str(e).splitlines()[0], span=source.span_at(0))


def _clip(word: str) -> str:
    """A word as a message quotes it: a name can be a megabyte long."""
    return word if len(word) <= 60 else f"{word[:40]}...({len(word):,} characters)"


def _token_span(tok: Token, source: Source) -> Span:
    if tok.start_pos is None:
        return source.span_at(max(0, len(source.text) - 1))
    return source.span(tok.start_pos, tok.end_pos or tok.start_pos + 1)


def _word_at(text: str, pos: int) -> str:
    end = pos
    while end < len(text) and (text[end].isalnum() or text[end] in "_-."):
        end += 1
    return text[pos:end]


def _unclosed_brace(source: Source) -> int | None:
    """Offset of the innermost '{' left open at end of input (comments and strings skipped)."""
    stack: list[int] = []
    text, i, n = source.text, 0, len(source.text)
    while i < n:
        ch = text[i]
        if ch == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        if ch == '"':
            close = text.find('"', i + 1)
            i = n if close < 0 else close + 1
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            stack.pop()
        i += 1
    return stack[-1] if stack else None
