"""`python -m streamworld`: the same command line as the `streamworld` script."""

from .cli import main

raise SystemExit(main())
