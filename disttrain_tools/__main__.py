"""``python -m disttrain_tools``: the command line (disttrain_tools/cli.py)."""

import sys

from disttrain_tools.cli import main

sys.exit(main())
