"""``python -m kvscope …`` — the same command line as ``kvscope …``."""

from .cli import main

raise SystemExit(main())
