"""``python -m hetero``: the command line."""
from hetero.cli import main

raise SystemExit(main())
