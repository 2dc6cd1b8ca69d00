"""How long a sequence fits? Step the length up until dilated attention runs out of memory.

    python examples/extreme_length.py                        # CPU: 2 GiB budget, small sizes
    python examples/extreme_length.py --max-memory-gib 8     # CPU: a bigger budget
    python examples/extreme_length.py --bisect 4             # GPU: bf16, until out of memory

A thin command line over ``benchmarks/bench_extreme.py`` (same flags, see ``--help``): for forward
only and for forward+backward it reports the largest sequence length that fits, the peak memory and
the memory per token, and writes ``extreme_length.json`` and ``extreme_length.png`` (``--out`` to
change).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_extreme


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv:
        argv += ["--out", "extreme_length"]
    record = bench_extreme.main(argv)
    for row in record["results"]:
        if row["max_seq_len"]:
            print(
                f"{row['mode']}: {row['max_seq_len']:,} tokens fit "
                f"({row['peak_gib']:.3f} GiB peak, {row['bytes_per_token'] / 1024:.1f} KiB/token; "
                f"stopped by {row['stopped_by']})"
            )
        else:
            print(f"{row['mode']}: not even the first length fits ({row['stopped_by']})")


if __name__ == "__main__":
    main()
