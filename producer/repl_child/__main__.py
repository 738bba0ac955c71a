"""The REPL child's program: ``python -I <this file> <cmd_fd> <reply_fd>`` (see the package), or a
bash cell's command, ``python -I -S <this file> --command NAME ARGS...`` (and ``--probe``).

The child must run where rlmq is not importable (another interpreter, ``-I``: no folder of ours
on ``sys.path``): this file loads its own folder as the package ``repl_child``, from its real
path, the one the sandbox carries in.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

PACKAGE = "repl_child"
"""The package's name in the child (``rlmq.producer.repl_child`` in the producer)."""


def _entry() -> ModuleType:
    """The module with ``main``: this folder loaded as :data:`PACKAGE`, unless it already is a
    package (``python -m rlmq.producer.repl_child``)."""
    if __package__:
        return importlib.import_module(".main", __package__)
    here = os.path.dirname(os.path.realpath(__file__))
    spec = importlib.util.spec_from_file_location(
        PACKAGE, os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.main")


if __name__ == "__main__":
    _self = sys.modules["__main__"]  # keep this module alive once the cells' __main__ replaces it
    sys.exit(_entry().main(sys.argv))
