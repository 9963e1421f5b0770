"""`python -m proxy ...` is the `recap` command."""

import sys

from proxy.ops.cli import main

sys.exit(main())
