"""``python -m otfload.cli``: the same as the ``otfload`` console script."""

from otfload.cli import main

raise SystemExit(main())
