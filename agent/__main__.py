"""`python -m agent` runs the same CLI as the `edge-agent` console script."""

from agent.service.cli import main

raise SystemExit(main())
