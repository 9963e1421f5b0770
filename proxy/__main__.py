"""`python -m proxy ...` is the `recap` command."""

import sys

from proxy.cli import main

sys.exit(main())
