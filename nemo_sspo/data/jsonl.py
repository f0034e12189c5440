r"""JSON Lines that survive any Unicode: records split on ``\\n`` only, and written with the other
line breaks escaped.

JSON strings may hold U+2028 (LINE SEPARATOR), U+2029 (PARAGRAPH SEPARATOR) and U+0085 (NEXT
LINE) unescaped (RFC 8259 section 7 requires escapes only below U+0020, for ``"`` and for ``\\``),
and scraped math text often does. Python's ``str.splitlines`` treats those three (and U+000B,
U+000C, U+001C-U+001E, ``\\r``) as line ends, so reading a JSONL file with it cuts such a record
in two broken lines. The JSON Lines format (https://jsonlines.org) separates records by ``\\n``
alone; :func:`jsonl_lines` splits there and nowhere else (a trailing ``\\r`` of a Windows line
end is JSON whitespace and stays harmless). :func:`jsonl_line` writes a record with the three
characters as ``\\u`` escapes, which decode to the same string, so the file also reads correctly in
tools that split on them; a record without them is written byte for byte as ``json.dumps(...,
ensure_ascii=False)`` writes it. docs/pitfalls.md#jsonl-line-breaks.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

__all__ = ["jsonl_line", "jsonl_lines"]

_UNICODE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
"""Line breaks for ``str.splitlines`` that ``json.dumps(..., ensure_ascii=False)`` leaves raw (the
others, U+000A-U+000D and U+001C-U+001E, are control characters it always escapes)."""


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    r"""The non-blank lines of a JSON Lines text, split on ``\\n`` only.

    Args:
        text: the whole file, decoded (UTF-8).

    Returns:
        An iterator of ``(line number, line)``, numbered from 1 as an editor counts ``\\n``-lines;
        blank lines (whitespace only) are skipped but keep their numbers.
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield number, line


def jsonl_line(record: Any) -> str:
    r"""One JSON Lines record: ``json.dumps(record, ensure_ascii=False)`` with U+2028, U+2029 and
    U+0085 escaped, plus the ending ``\\n``.

    Args:
        record: a JSON-serialisable value (usually a dict).

    Returns:
        The line, ``\\n`` included; ``json.loads`` of it (without the ``\\n``) equals ``record``.

    Raises:
        TypeError: ``record`` is not JSON-serialisable (from ``json.dumps``).
    """
    text = json.dumps(record, ensure_ascii=False)
    for char, escape in _UNICODE_BREAKS.items():
        if char in text:  # outside strings json.dumps writes none of these, so only strings change
            text = text.replace(char, escape)
    return text + "\n"
