"""Terminal tables shared by the commands."""
from __future__ import annotations

import sys
from typing import Sequence


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None,
                file=None) -> None:
    """Print an aligned table (rich on a terminal, plain columns otherwise so logs stay
    greppable)."""
    file = file or sys.stdout
    if file.isatty():
        from rich.console import Console
        from rich.table import Table
        table = Table(*headers, title=title)
        for row in rows:
            table.add_row(*row)
        Console(file=file).print(table)
        return
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    if title:
        print(title, file=file)
    for row in [headers, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip(), file=file)
