"""`python -m brokerd`: the daemon's command line (brokerd/daemon/main.py)."""

from brokerd.daemon.main import main

raise SystemExit(main())
