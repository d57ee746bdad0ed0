"""``python -m precache``: the ``precache`` command."""

from precache.cli import main

raise SystemExit(main())
