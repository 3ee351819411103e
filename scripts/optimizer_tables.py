#!/usr/bin/env python
"""Generate docs/optimizer.md: the optimiser's formulation, its plans on the
paper's 16-core profiles, measured solve times and, if given, the profiles of
the demo models (each on the machine its fingerprint names).

    .venv/bin/python scripts/optimizer_tables.py [PROFILE.json ...] [-o docs/optimizer.md]

Without profile arguments it uses profiles/*.json if any exist (written by
`packrat profile`); otherwise the demo section says how to fill it.
Everything in the file is computed (packrat.bench.optimizer_doc), so it is rerun, not edited.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.optimizer_doc import write_optimizer_doc
from packrat.bench.paths import DOCS
from packrat.commands.plan import run_plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="*", type=Path, help="demo-model profile JSON files")
    ap.add_argument("-o", "--output", type=Path, default=DOCS / "optimizer.md")
    args = ap.parse_args()
    print(write_optimizer_doc(args.profiles, args.output, run_plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
