"""`python -m clients ...`: the streaming client CLI (see clients/cli.py)."""

import sys

from clients.cli import main

sys.exit(main())
