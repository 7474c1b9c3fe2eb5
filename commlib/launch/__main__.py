"""``python -m commlib.launch``."""

from commlib.launch import main

raise SystemExit(main())
