"""``python -m producer`` runs the ``rlmq`` command line."""

import sys

from producer.cli import main

sys.exit(main())
