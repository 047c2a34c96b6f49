"""``python -m kvscope.cli …`` — the same command line as ``kvscope …``."""

from . import main

raise SystemExit(main())
