"""The run folder while the run goes: rows appended as rollouts finish, and resuming from it.

``rlmq run`` / ``rlmq demo`` create the run folder before the first rollout starts, with a
``meta.json`` that says ``"status": "running"``, and append each finished rollout to
``rows.jsonl`` and ``trajectories.jsonl`` there as it finishes (flushed, so another process
can read them mid-run, and a ``kill -9`` leaves them). At the end, or on a stop signal,
:func:`rlmq.cli.report.write_run` rewrites the folder in dataset order with the report.

``rlmq run --resume RUN_DIR`` reads the rows of an earlier run's folder (:meth:`LiveRunFolder.
load`): those that finished without ``error`` are kept and not run again; the rest are run and
appended there. The rows to be kept must come from the same rollouts: a resume whose model,
sub-model or rollout options differ from those the folder's ``meta.json`` recorded (written when
the run started) is refused, naming the flags, except for the options in
:data:`RESUME_MAY_CHANGE` (deadlines and limits that do not shape a finished rollout).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rlmq.common.errors import ConfigError
from rlmq.common.schemas import ResultRow
from rlmq.common.settings import RolloutOptions
from rlmq.common.token_wire import expand_trajectory

if TYPE_CHECKING:
    from collections.abc import Callable

    from rlmq.producer.env import RolloutResult

ROWS = "rows.jsonl"
TRAJECTORIES = "trajectories.jsonl"
META = "meta.json"
LOCK = ".lock"
"""Held (``flock``) by the run writing the folder; the kernel lets go of it when that process ends."""
RESUME_MAY_CHANGE = frozenset(
    {"rollout_timeout", "sub_call_timeout", "max_startup_wait_seconds", "rollout_key_ttl", "max_sub_llm_parallelism"}
)
"""Rollout options a resumed run may set otherwise: how long or how wide it may run, not what it computes."""
RESUME_SAME = tuple(  # each once: sub_model is a rollout option too
    dict.fromkeys(("model", "sub_model", *(n for n in RolloutOptions.model_fields if n not in RESUME_MAY_CHANGE)))
)
"""The settings a resumed run must share with the run whose rows it keeps."""


def trajectory_line(res: RolloutResult) -> str:
    """One line of ``trajectories.jsonl``: ``id``, ``rollout`` (with several per row), ``messages``, ``trajectory``
    (token records as JSON lists, :func:`~rlmq.common.token_wire.expand_trajectory`)."""
    record: dict[str, Any] = {
        "id": res.row.id,
        "messages": res.messages,
        "trajectory": expand_trajectory(res.trajectory),
    }
    if res.row.rollout is not None:
        record["rollout"] = res.row.rollout
    return json.dumps(record, default=str) + "\n"


class LiveRunFolder:
    """A run folder written as the run goes.

    Args:
        folder: the run folder (created, parents too, by :meth:`open`).
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        self._rows: IO[str] | None = None
        self._trajectories: IO[str] | None = None
        self._lock: IO[str] | None = None

    def load(self) -> list[RolloutResult]:
        """The rollouts of an earlier run in this folder that finished without ``error``.

        Raises:
            ConfigError: the folder has no ``rows.jsonl``, or a line of it is not a result row.
        """
        from rlmq.producer.env import RolloutResult

        rows_file = self.path / ROWS
        if not rows_file.is_file():
            raise ConfigError(f"--resume {self.path}: no {ROWS} there (not a run folder of rlmq run)")
        trajectories: dict[tuple[str, int], dict[str, Any]] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / TRAJECTORIES).read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    t = json.loads(line)
                    trajectories[(str(t["id"]), int(t.get("rollout", 0)))] = t
        kept: dict[tuple[str, int], RolloutResult] = {}
        lines = rows_file.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = ResultRow.model_validate_json(line)
            except ValueError as exc:
                if n == len(lines):
                    break  # the last line of a killed run may be cut short: it did not finish
                raise ConfigError(f"--resume {self.path}: line {n} of {ROWS} is not a result row") from exc
            key = row.key
            if row.stop_reason == "error":
                kept.pop(key, None)
                continue
            t = trajectories.get(key, {})
            kept[key] = RolloutResult(row=row, trajectory=t.get("trajectory", []), messages=t.get("messages", []))
        return list(kept.values())

    def check_resume(self, settings: dict[str, Any], label: Callable[[str], str] = str) -> None:
        """Refuse to resume with other settings than the run recorded in ``meta.json``.

        Args:
            settings: this run's settings (``Settings.model_dump(mode="json")``), with
                ``sub_model`` set.
            label: how the command line names a setting (its flag).

        Raises:
            ConfigError: one of :data:`RESUME_SAME` differs (the message names each flag, with
                the value the run had and the one given now).
        """
        try:
            recorded = json.loads((self.path / META).read_text(encoding="utf-8")).get("settings")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if not isinstance(recorded, dict):
            return  # a folder from before settings were recorded at the start: nothing to compare
        differ = [
            f"{label(name)} {json.dumps(recorded.get(name))} (now {json.dumps(settings.get(name))})"
            for name in RESUME_SAME
            if name in recorded and recorded.get(name) != settings.get(name)
        ]
        if differ:
            raise ConfigError(
                f"--resume {self.path}: that run had {'; '.join(differ)}; give the same flags to resume it, "
                "or start a new run folder"
            )

    def open(self, meta: dict[str, Any], kept: list[RolloutResult]) -> None:
        """Create the folder, write ``meta.json`` (``"status": "running"``) and start
        ``rows.jsonl`` and ``trajectories.jsonl`` with ``kept`` (a resumed run's finished rows).

        Raises:
            OSError: the folder cannot be written.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        (self.path / META).write_text(json.dumps({**meta, "status": "running"}, indent=2, default=str) + "\n")
        for name, attr, text in (
            (ROWS, "_rows", "".join(json.dumps(r.row.model_dump()) + "\n" for r in kept)),
            (TRAJECTORIES, "_trajectories", "".join(trajectory_line(r) for r in kept)),
        ):
            tmp = self.path / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path / name)  # the earlier error rows go; the finished ones stay
            setattr(self, attr, open(self.path / name, "a", encoding="utf-8"))  # noqa: SIM115 - closed in close()

    def _take_lock(self) -> None:
        """Hold the folder's lock until this process ends (or :meth:`unlock`).

        Raises:
            ConfigError: another live process holds it (a run still writing this folder).
        """
        if self._lock is not None:
            return
        fh = open(self.path / LOCK, "a+", encoding="utf-8")  # noqa: SIM115 - held until unlock() or exit
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            pid = fh.read().strip() or "?"
            fh.close()
            raise ConfigError(
                f"run folder {self.path} is in use by another rlmq run (pid {pid}); wait for it to end "
                "(or stop it), or give another --run-dir"
            ) from None
        except OSError:  # a filesystem without locks (ENOLCK): run unguarded rather than not at all
            fh.close()
            return
        fh.truncate(0)
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._lock = fh

    def unlock(self) -> None:
        """Let go of the folder's lock (idempotent): the run is done writing it."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def append(self, res: RolloutResult) -> None:
        """Append a finished rollout's row and trajectory, flushed."""
        if self._rows is None or self._trajectories is None:
            return
        self._trajectories.write(trajectory_line(res))
        self._trajectories.flush()
        self._rows.write(json.dumps(res.row.model_dump()) + "\n")
        self._rows.flush()

    def close(self) -> None:
        """Close the files (idempotent); the folder stays."""
        for fh in (self._rows, self._trajectories):
            if fh is not None:
                fh.close()
        self._rows = self._trajectories = None
