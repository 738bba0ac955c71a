"""``python -m rlmq`` runs the ``rlmq`` command line."""

import sys

from rlmq.producer.cli import main

sys.exit(main())
