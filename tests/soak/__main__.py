"""``python -m tests.soak``: run the bounded soak and print its figures; exit 1 if a check failed."""

from __future__ import annotations

from tests.soak.run import main

if __name__ == "__main__":
    raise SystemExit(main())
