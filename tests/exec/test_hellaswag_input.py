"""Issue #42, a HellaSwag .jsonl that is not one: each line that cannot be an example is a
DataError naming the file and the line, whatever it holds (deep nesting, digits that are
not ASCII, a number of thousands of digits, a line of megabytes), and the memory the reader
takes is in proportion to what it keeps, not to what it is given. A valid line stays valid:
JSON lets a string hold a raw U+2028, and HellaSwag's lines are split on "\\n" alone."""

from __future__ import annotations

import json
import textwrap
import tracemalloc

import pytest

from schedc.model.data import DataError
from schedc.model.hellaswag import MAX_LINE, read_hellaswag
from tests.ranks import python

GOOD = {"ctx": "A man sits down.", "endings": ["He eats.", "He runs.", "He naps.", "No."]}


def line(**fields) -> str:
    return json.dumps({**GOOD, "label": 0, **fields})


def refused(tmp_path, text: str) -> str:
    """The DataError's message for a file whose first line is good and second is `text`."""
    f = tmp_path / "h.jsonl"
    f.write_text(line() + "\n" + text + "\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_hellaswag(str(f), 64)
    message = str(e.value)
    assert message.startswith(f"{f}:2: "), message
    assert "\n" not in message and len(message) < 300, message
    return message


CASES = {
    "brackets-in-a-string": (line(extra="[" * 100_000), None),  # no nesting at all: accepted
    "nested-100000-deep": (
        line()[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "nested",
    ),
    "open-braces": (line()[:-1] + ', "deep": ' + "{" * 50_000 + "}", "not a JSON object"),
    "label-superscript-two": (line(label="\u00b2"), '"label" must be 0-3'),
    "label-arabic-indic-three": (line(label="\u0663"), '"label" must be 0-3'),
    "label-text-5000-digits": (line(label="1" * 5000), '"label" must be 0-3, got a text of 5000'),
    "label-5000-digits": (
        line()[:-2] + "1" * 5000 + "}",
        '"label" must be 0-3, got a number of 5000',
    ),
    "label-minus-zero": (line(label="-0"), '"label" must be 0-3'),
    "label-space-one": (line(label=" 1"), '"label" must be 0-3'),
    "label-float": (line(label=1.0), '"label" must be 0-3, got 1.0'),
    "label-bool": (line(label=True), '"label" must be 0-3, got True'),
}


@pytest.mark.parametrize("text, want", list(CASES.values()), ids=list(CASES))
def test_a_line_that_is_not_an_example_is_named_with_its_line(tmp_path, text, want):
    if want is None:
        f = tmp_path / "h.jsonl"
        f.write_text(text + "\n")
        assert len(read_hellaswag(str(f), 64)[0]) == 1
        return
    assert want in refused(tmp_path, text)


def test_labels_as_text_are_ascii_decimals(tmp_path):
    f = tmp_path / "h.jsonl"
    f.write_text("\n".join(line(label=v) for v in ("3", 2, "01")) + "\n")
    examples, _ = read_hellaswag(str(f), 64)
    assert [e.label for e in examples] == [3, 2, 1]


def test_a_raw_line_separator_inside_a_string_is_valid_json(tmp_path):
    """U+2028 and U+2029 need no escape in JSON; str.splitlines cut the line there."""
    f = tmp_path / "h.jsonl"
    text = json.dumps({**GOOD, "ctx": "A man\u2028sits\u2029down.\x85", "label": 2})
    text = text.replace("\\u2028", "\u2028").replace("\\u2029", "\u2029")
    text = text.replace("\\u0085", "\x85")
    assert "\u2028" in text and "\\u2028" not in text
    f.write_text(text + "\r\n" + line(label=1) + "\n", encoding="utf-8")
    examples, seen = read_hellaswag(str(f), 64)
    assert [e.label for e in examples] == [2, 1]
    assert seen.startswith("2 examples, sha256 ")


def test_the_fingerprint_is_the_files_sha256(tmp_path):
    import hashlib

    f = tmp_path / "h.jsonl"
    f.write_text("\n".join(line(label=i) for i in range(4)) + "\n\n")
    _, seen = read_hellaswag(str(f), 64)
    assert seen == f"4 examples, sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}"


def test_a_line_of_32_mib_is_refused_without_being_read_whole(tmp_path):
    """A valid example padded to 32 MiB by a key the reader ignores: refused at the
    line's cap, and the reader's Python allocations never near the line's size."""
    f = tmp_path / "h.jsonl"
    f.write_text(line() + "\n" + line(pad="x" * (32 << 20)) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as e:
            read_hellaswag(str(f), 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(e.value).startswith(f"{f}:2: longer than {MAX_LINE >> 10} KiB"), str(e.value)
    assert peak < 4 * MAX_LINE + (4 << 20), peak


def test_the_memory_kept_is_in_proportion_to_the_file(tmp_path):
    """100,000 examples of the smallest kind (47 bytes a line): what the examples keep
    is a few times the file, not the ~1.7 KB an example of two small tensors took."""
    f = tmp_path / "h.jsonl"
    small = json.dumps({"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0})
    f.write_text((small + "\n") * 100_000)
    script = textwrap.dedent(
        f"""
        import gc, os

        from schedc.model.hellaswag import read_hellaswag, render
        render("warm", ["a", "b", "c", "d"], 0).tokens  # torch and the tokenizer loaded
        def resident():  # bytes of this process in memory now
            gc.collect()
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        before = resident()
        examples, _ = read_hellaswag({str(f)!r}, 64)
        assert len(examples) == 100_000
        print(resident() - before)
        """
    )
    done = python("-c", script, timeout=300)
    assert done.returncode == 0, done.stderr
    grown, size = int(done.stdout.split()[-1]), f.stat().st_size
    assert grown < 8 * size, (grown, size)
