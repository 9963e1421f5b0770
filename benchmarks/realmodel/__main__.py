"""`python -m benchmarks.realmodel`: see benchmarks/realmodel/run.py."""

import sys

from benchmarks.realmodel.run import main

sys.exit(main())
