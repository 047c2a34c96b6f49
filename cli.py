#!/usr/bin/env python3
"""Run the kvscope CLI from a checkout: ``python cli.py trace ...``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvscope.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
