"""Entry point of ``python -m commlib.bench`` and of the ``commlib-bench`` console script."""

from __future__ import annotations

from commlib.bench._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
