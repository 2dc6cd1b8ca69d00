"""Draw the dilation pattern of a LongNet schedule: docs/dilation_pattern.png.

    python docs/plot_dilation.py

For N = 32 and branches (w, r) = (8, 1), (16, 2), (32, 4), each panel shows, for one head, how many
branches let query p (row) see key t (column) under a causal mask: the multiplicity the mixed
softmax weights keys by (LongNet Eq. 10). Head j uses offset j mod r in every branch.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

N = 32
BRANCHES = [(8, 1), (16, 2), (32, 4)]
HEADS = 4


def multiplicity(head: int) -> np.ndarray:
    """(N, N) count of branches covering (query, key) for this head, causal."""
    m = np.zeros((N, N), dtype=int)
    for w, r in BRANCHES:
        for t0 in range(0, N, w):
            rows = [t0 + i for i in range(head % r, min(w, N - t0), r)]
            for p in rows:
                for t in rows:
                    if t <= p:
                        m[p, t] += 1
    return m


def main() -> None:
    fig, axes = plt.subplots(1, HEADS, figsize=(3.2 * HEADS, 3.6))
    cmap = plt.get_cmap("viridis", len(BRANCHES) + 1)
    for head, ax in enumerate(axes):
        image = ax.imshow(multiplicity(head), cmap=cmap, vmin=-0.5, vmax=len(BRANCHES) + 0.5)
        ax.set_title(f"head {head}")
        ax.set_xlabel("key position")
        if head == 0:
            ax.set_ylabel("query position")
    schedule = ", ".join(f"(w={w}, r={r})" for w, r in BRANCHES)
    fig.suptitle(f"Branches covering each (query, key) pair, causal, N={N}: {schedule}")
    fig.colorbar(image, ax=axes, ticks=range(len(BRANCHES) + 1), fraction=0.015, pad=0.02)
    out = Path(__file__).with_name("dilation_pattern.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
