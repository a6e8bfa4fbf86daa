"""`make chaos`: `python -m tests.chaos --duration-s S --mode server|owner` (harness.py)."""

from tests.chaos.harness import main

raise SystemExit(main())
