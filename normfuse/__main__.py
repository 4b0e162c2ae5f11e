"""``python -m normfuse``: the command line (normfuse/cli.py)."""

from normfuse.cli import main

raise SystemExit(main())
