"""``python -m rlmq`` runs the ``rlmq`` command line."""

import sys

from rlmq.cli.main import main

sys.exit(main())
