"""``python -m metricsvc``: the ``metricsvc`` command."""

import sys

from metricsvc.cli.main import main

sys.exit(main())
