"""The REPL sandbox: one persistent Python subprocess per rollout.

The root model's code runs in a child interpreter (``producer/repl_child/``, stdlib
only, a program of its own) in which the long input is the variable ``context``, ``llm_batch`` posts
prompts to the rollout's interception server, and ``answer`` holds the final answer.

Modules: :mod:`.session` (:class:`Repl`, the producer's view of one REPL), :mod:`.cell`
(:class:`CellResult`, a cell's clock and wait), :mod:`.handle` (:class:`ChildHandle`, the
parent's handle on one child process), :mod:`.output` (bounded cell output), :mod:`.launch`
(environment, interpreter, pip installs, spawning a child),
:mod:`.containment` (what a child is contained by; said once when it is not fully).
"""

from rlmq.producer.repl.cell import CellResult
from rlmq.producer.repl.containment import Containment, containment_seen
from rlmq.producer.repl.output import truncate_output
from rlmq.producer.repl.session import Repl

__all__ = ["CellResult", "Containment", "Repl", "containment_seen", "truncate_output"]
