"""``python -m shmkv.bench.tiers``: the suite's command line (:func:`main`)."""

import sys

from shmkv.bench.tiers import main

sys.exit(main())
