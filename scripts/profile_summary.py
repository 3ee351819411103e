#!/usr/bin/env python3
"""Markdown summary of saved profiles (for docs/profiler.md): run time, points, latency table.

    python scripts/profile_summary.py docs/profiles/*.json

Reads only the saved files; measures nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from packrat.bench.profile_summary import summarize


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("\n".join(summarize(Path(a)) for a in argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
