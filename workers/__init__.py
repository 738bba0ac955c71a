"""``rlmq.workers``: the repository's top-level folder ``workers/``, a subpackage of ``rlmq``.

It has one import name. Imported as ``workers`` (the checkout's root on ``sys.path``, e.g. under
pytest's default import mode) it would be a second copy of every module, with classes of its
own (which ``isinstance`` and ``except`` of the real ones do not match), so that import stops here.

Internal: no module of this package is part of rlmq's supported API, which is the names of
``rlmq.__all__`` (import them from ``rlmq``, even those defined here), the plug-ins and the ``rlmq``
command. Any module here may change in any release (docs/design.md, "Public and internal").
"""

if __name__ != "rlmq.workers":
    raise ImportError(
        f"the folder workers/ is the package rlmq.workers: import rlmq.workers, not {__name__!r} "
        "(a second copy of it would have classes of its own)"
    )
