"""mkdocs hook for the command reference: an option without a default shows none.

Click 8.3 marks a missing default with its ``UNSET`` sentinel, which mkdocs-click (0.9) prints, as
``Sentinel.UNSET``, as the default of every such option (``--help`` included); ``to_info_dict`` gives what
click's own help means by it (``None``, ``False`` for a flag).
"""

from __future__ import annotations

import copy
from typing import Any

import click
from mkdocs_click import _docs

UNSET = getattr(click.core, "UNSET", None)  # click < 8.3 has none: nothing to replace


def on_startup(**kwargs: Any) -> None:
    """Wrap mkdocs-click's table row once per build process."""
    row = _docs._format_table_option_row
    if UNSET is None or getattr(row, "unset_replaced", False):
        return

    def format_row(option: click.Option) -> str:
        if option.default is UNSET:
            option = copy.copy(option)
            option.default = option.to_info_dict()["default"]
        return row(option)

    format_row.unset_replaced = True  # type: ignore[attr-defined]
    _docs._format_table_option_row = format_row
