"""What ``rlmq run`` / ``rlmq demo`` keep: result rows in dataset order, never a destroyed file.

:class:`ResultSink` collects the finished rollouts of an evaluation. While it runs, each
finished row is appended to ``<output>.partial`` (so even a ``kill -9`` leaves the rows that
finished); at the end, and also when a signal stopped the run, the rows that finished are
written in the dataset's order to a temporary file beside ``--output`` and renamed onto it.
``--output`` itself is therefore never opened for writing before the run has results: a run
that fails to start (Redis unreachable, a bad dataset) leaves an earlier file as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

from rlmq.common.errors import ConfigError
from rlmq.common.schemas import DatasetRow, read_dataset

if TYPE_CHECKING:
    from rlmq.producer.env import RolloutResult


def check_output(output: str | None) -> None:
    """Refuse, before anything starts, an ``--output`` that could not be written.

    Raises:
        ConfigError: its folder does not exist or is not writable, or it is a folder.
    """
    if output is None:
        return
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ConfigError(f"--output {output}: the folder {folder} does not exist")
    if os.path.isdir(output):
        raise ConfigError(f"--output {output} is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--output {output}: the folder {folder} is not writable")


def load_rows(path: str) -> list[DatasetRow]:
    """The rows of the JSONL dataset at ``path``, checked before anything starts.

    Raises:
        ConfigError: the file cannot be read, holds no row, or two rows share an ``id``
            (result rows are matched to dataset rows by ``id``).
        PayloadError: a line is not a dataset row (:func:`~common.schemas.read_dataset`).
    """
    try:
        rows = read_dataset(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the dataset {path}: {exc.strerror or exc}") from exc
    if not rows:
        raise ConfigError(f"the dataset {path} has no rows (JSONL: one {{id, question, context}} object per line)")
    seen: dict[str, int] = {}
    for i, row in enumerate(rows, 1):
        if row.id in seen:
            raise ConfigError(f"the dataset {path} has the id {row.id!r} twice (rows {seen[row.id]} and {i})")
        seen[row.id] = i
    return rows


class ResultSink:
    """The finished rollouts of one evaluation, kept in the dataset's order.

    Args:
        rows: the dataset rows (ids unique, see :func:`load_rows`).
        output: the ``--output`` file, or ``None``.
    """

    def __init__(self, rows: Sequence[DatasetRow], output: str | None) -> None:
        self.order = {row.id: i for i, row in enumerate(rows)}
        self.total = len(rows)
        self.output = output
        self.partial = f"{output}.partial" if output else None
        self._done: dict[int, RolloutResult] = {}
        self._fh: IO[str] | None = None

    def add(self, res: RolloutResult) -> None:
        """Keep a finished rollout and append its row to ``<output>.partial``."""
        self._done[self.order.get(res.row.id, len(self.order) + len(self._done))] = res
        if self.partial is not None:
            if self._fh is None:
                self._fh = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 - closed in commit()
            self._fh.write(json.dumps(res.row.model_dump()) + "\n")
            self._fh.flush()

    @property
    def results(self) -> list[RolloutResult]:
        """The finished rollouts, in the dataset's order."""
        return [self._done[i] for i in sorted(self._done)]

    def commit(self) -> bool:
        """Write the finished rows, in dataset order, to ``--output`` (a temporary file in the
        same folder, renamed onto it) and remove ``<output>.partial``.

        Nothing is written when no rollout finished: an earlier ``--output`` stays as it was.

        Returns:
            Whether ``--output`` was written.
        """
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.output is None or not self._done:
            return False
        folder = os.path.dirname(os.path.abspath(self.output))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.output)}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                for res in self.results:
                    fh.write(json.dumps(res.row.model_dump()) + "\n")
            os.replace(tmp, self.output)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.partial)
        return True
