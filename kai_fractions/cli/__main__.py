"""`python -m kai_fractions.cli`: the `kai-fractions` console script, without its install."""

from . import main

raise SystemExit(main())
