# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What the benchmarks share to show their results: aligned text tables and saved figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def align(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines, each column right-aligned to its widest cell."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]


def save(fig: Any, axes: list[Any], path: Path) -> None:
    """Legend, grid and whole-number request axes on every plot, then write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
