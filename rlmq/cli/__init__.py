"""The ``rlmq`` command line and operator tooling: a layer above both sides of the queue.

It imports ``rlmq.producer`` and ``rlmq.workers`` plainly (neither imports it): ``main`` parses
the command line, ``worker`` runs ``rlmq worker``, ``local`` starts a whole deployment on one
machine, ``demo`` builds the demo's rows, ``report`` writes a run's folder, ``status`` shows a
fleet.
"""
