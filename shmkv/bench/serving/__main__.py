"""``python -m shmkv.bench.serving``: the suite's command line (:func:`main`)."""

import sys

from shmkv.bench.serving import main

sys.exit(main())
