"""`python -m benchmarks.bench ...` is `slipstream bench ...`."""
import sys

from benchmarks.bench.run import main

sys.exit(main())
