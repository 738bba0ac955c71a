"""What ``rlmq run`` / ``rlmq demo`` keep and print: result rows in dataset order (never a
destroyed file), the run folder, the summary, and the exit code.

:class:`ResultSink` collects the finished rollouts of an evaluation. While it runs, each
finished row is appended to ``<output>.partial`` (so even a ``kill -9`` leaves the rows that
finished); at the end, and also when a signal stopped the run, the rows that finished are
written in the dataset's order to a temporary file beside ``--output`` and renamed onto it.
``--output`` itself is therefore never opened for writing before the run has results: a run
that fails to start (Redis unreachable, a bad dataset) leaves an earlier file as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

from rlmq.cli.exits import EXIT_BUDGET_STARVED, EXIT_OK, EXIT_ROLLOUT_ERRORS, EXIT_SUB_CALLS_FAILED, say
from rlmq.common.aio import current_latch
from rlmq.common.connection import mask_url
from rlmq.common.errors import ConfigError
from rlmq.common.schemas import DatasetRow, read_dataset
from rlmq.common.settings import setting_default
from rlmq.producer.tree_metrics import is_tree_metric

if TYPE_CHECKING:
    from rlmq.cli.run_folder import LiveRunFolder
    from rlmq.common.settings import Settings
    from rlmq.producer.env import RolloutResult


def check_output(output: str | None, dataset: str | None = None, run_dir: str | None = None) -> None:
    """Refuse, before anything starts, an ``--output`` that could not be written (or would
    overwrite the ``dataset``), and a ``--run-dir`` that is a file.

    Raises:
        ConfigError: its folder does not exist or is not writable, it is a folder, it is
            the dataset, or ``run_dir`` exists and is not a folder.
    """
    if run_dir is not None and os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--run-dir {run_dir} exists and is not a folder")
    if output is None:
        return
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ConfigError(f"--output {output}: the folder {folder} does not exist")
    if os.path.isdir(output):
        raise ConfigError(f"--output {output} is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--output {output}: the folder {folder} is not writable")
    if dataset and os.path.exists(output) and os.path.exists(dataset) and os.path.samefile(output, dataset):
        raise ConfigError(f"--output {output} is the dataset itself; give another file")


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

    def __init__(
        self,
        rows: Sequence[DatasetRow],
        output: str | None,
        *,
        rollouts_per_example: int = setting_default("rollouts_per_example"),
        run_dir: LiveRunFolder | None = None,
    ) -> None:
        self.order = {row.id: i for i, row in enumerate(rows)}
        self.total = len(rows) * rollouts_per_example
        self.output = output
        self.run_dir = run_dir
        # a FIFO or a device (``--output /dev/stdout``) gets the rows streamed into it at the end,
        # and no ``.partial`` beside it
        self._stream = output is not None and os.path.exists(output) and not os.path.isfile(output)
        self.partial = f"{output}.partial" if output and not self._stream else None
        self._done: dict[tuple[int, int], RolloutResult] = {}
        self._fh: IO[str] | None = None

    def check_kept(self, kept: Sequence[RolloutResult]) -> None:
        """Refuse a resumed run's rollouts that are not of this dataset.

        Raises:
            ConfigError: a row id is not in this dataset.
        """
        for res in kept:
            if res.row.id not in self.order:
                raise ConfigError(f"--resume: the run folder holds row {res.row.id!r}, which is not in this dataset")

    def keep(self, res: RolloutResult) -> None:
        """Keep a rollout that an earlier run finished (``--resume``), writing nothing.

        Raises:
            ConfigError: its row id is not in this dataset.
        """
        self.check_kept([res])
        self._done[(self.order[res.row.id], res.row.key[1])] = res

    def add(self, res: RolloutResult) -> None:
        """Keep a finished rollout and append its row to ``<output>.partial`` and the run folder."""
        self._done[(self.order.get(res.row.id, len(self.order) + len(self._done)), res.row.key[1])] = res
        if self.run_dir is not None:
            self.run_dir.append(res)
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
        if self.run_dir is not None:
            self.run_dir.close()
        if self.output is None or not self._done:
            return False
        if self._stream:  # never renamed onto: that would replace the FIFO or device node itself
            with open(self.output, "w", encoding="utf-8") as fh:
                for res in self.results:
                    fh.write(json.dumps(res.row.model_dump()) + "\n")
            return True
        target = os.path.realpath(self.output)  # a symlink keeps pointing where it did
        folder = os.path.dirname(target)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
        try:
            umask = os.umask(0o022)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                for res in self.results:
                    fh.write(json.dumps(res.row.model_dump()) + "\n")
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.partial)
        return True


def summarize(rows: list[dict[str, Any]]) -> str:
    """Accuracy, stop reasons and mean metrics of result rows, as text."""
    n = len(rows)
    graded = [r for r in rows if r["correct"] is not None]
    right = sum(1 for r in graded if r["correct"])
    lines = [f"rollouts: {n}"]
    if graded:
        lines.append(f"accuracy: {right}/{len(graded)} = {right / len(graded):.1%}")
    stops = Counter(r["stop_reason"] for r in rows)
    lines.append("stop reasons: " + ", ".join(f"{k}={v}" for k, v in sorted(stops.items())))
    errors = [r for r in rows if r.get("error")]
    for r in errors[:5]:
        lines.append(f"  error in {r['id']}: {r['error']}")
    whole = tree_totals(rows)
    calls, failed, refused = whole["sub_calls"], whole["sub_failed"], whole["sub_rejected"]
    if calls:
        # In all, not as a mean, and over the whole tree of each rollout: a run whose sub-calls all
        # failed (no worker on the queue, say) must not look healthy because its rollouts answered.
        line = f"sub-LLM calls: {calls} in all, {failed} ended in error, {refused} rejected by the budget"
        first = next((r["sub_llm_error"] for r in rows if r.get("sub_llm_error")), None)
        cause = f"  <- the first: {first}" if first else "  <- see the errors in the run folder's report"
        lines.append(line + (cause if failed else ""))
    rlm_calls = whole["rlm_tasks"]
    if rlm_calls:
        lines.append(
            f"rlm_batch: {rlm_calls} task(s) in all, {whole['children']} child rollout(s) reported, "
            f"{whole['charged']} completion tokens charged to the trees' budgets; "
            f"the deepest tree reached depth {whole['depth']}"
        )
    if whole["budget_spent"]:
        starved = whole["starved_rollouts"]
        lines.append(
            f"budget: {whole['budget_spent']} child rollout(s) ended by the tree budget (budget_spent) in "
            f"{starved} of {n} rollout(s)  <- the budget starved these trees; "
            "raise --sub-llm-max-completion-tokens"
        )
    keys: list[str] = []
    for r in rows:
        # the tree figures (producer/tree_metrics.py) say nothing in a run that started no child
        keys += [k for k in r["metrics"] if k not in keys and (rlm_calls or not is_tree_metric(k))]
    if keys:
        lines.append("metrics (mean over rollouts):")
        for k in keys:
            vals = [r["metrics"][k] for r in rows if k in r["metrics"]]
            lines.append(f"  {k:<36} {sum(vals) / len(vals):>14.4f}")
    return "\n".join(lines)


def whole_figure(metrics: dict[str, Any], tree_key: str, own_key: str) -> int:
    """``metrics[tree_key]`` (the rollout's whole tree) when the row has it, else ``metrics[own_key]``."""
    value = metrics[tree_key] if tree_key in metrics else metrics.get(own_key, 0)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def tree_totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Whole-tree figures of result rows, summed over the rows (every rollout's own calls and
    those of all its child rollouts, :mod:`rlmq.producer.tree_metrics`).

    Returns:
        ``sub_calls``, ``sub_failed``, ``sub_rejected``: sub-LLM calls, those that ended in
        ``error``, those the budget rejected; ``rlm_tasks``: ``rlm_batch`` tasks; ``children``:
        child rollouts that reported; ``depth``: the deepest depth a rollout reached (1 without
        children); ``charged``: completion tokens charged to the trees' budgets;
        ``budget_spent``: child rollouts the budget ended; ``starved_rollouts``: rows with one or more.
    """
    out = dict.fromkeys(
        ("sub_calls", "sub_failed", "sub_rejected", "rlm_tasks", "children", "depth", "charged", "budget_spent"), 0
    )
    out["starved_rollouts"] = 0
    for r in rows:
        m = r.get("metrics") or {}
        rejected = whole_figure(m, "tree_sub_llm_rejected_count", "sub_llm_rejected_count")
        # sub_llm_call_count counts the calls that ran; "in all" adds those the budget refused
        out["sub_calls"] += whole_figure(m, "tree_sub_llm_call_count", "sub_llm_call_count") + rejected
        out["sub_failed"] += whole_figure(m, "tree_sub_llm_error_count", "sub_llm_error_count")
        out["sub_rejected"] += rejected
        out["rlm_tasks"] += whole_figure(m, "rlm_call_count", "rlm_call_count")
        out["children"] += max(0, whole_figure(m, "tree_rollout_count", "tree_rollout_count") - 1)
        out["depth"] = max(out["depth"], whole_figure(m, "tree_depth", "tree_depth") or 1)
        out["charged"] += whole_figure(m, "tree_charged_completion_tokens", "tree_charged_completion_tokens")
        spent = whole_figure(m, "tree_budget_spent_count", "tree_budget_spent_count")
        out["budget_spent"] += spent
        out["starved_rollouts"] += spent > 0
    return out


def public_argv(argv: list[str]) -> list[str]:
    """``argv`` with secrets masked (the value of ``--api-key``, passwords in URLs)."""
    out: list[str] = []
    hide = False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(mask_url(a))
    return out


def save_run(
    args: argparse.Namespace, results: list[RolloutResult], settings: Settings, started: float, extra: dict[str, Any]
) -> None:
    """Write the run folder (``--run-dir`` or ``runs/<UTC time>-<command>``) and print where it is."""
    from rlmq.cli.report import default_run_dir, write_run

    folder = args.run_dir or default_run_dir(args.command)  # set before the run, when it started
    meta = {
        "command": ["rlmq", *public_argv(getattr(args, "argv", None) or [args.command])],
        "settings": settings.model_dump(mode="json", exclude={"api_key"}),
        "started": started,
        "finished": time.time(),
        **extra,
    }
    path = write_run(folder, results, meta)
    print(f"run folder: {path}")
    print(f"report: {path / 'report.html'}")


def finish(
    args: argparse.Namespace,
    sink: ResultSink,
    settings: Settings,
    started: float,
    extra: dict[str, Any],
    *,
    interrupted: bool = False,
) -> int:
    """Keep what finished (``--output`` in dataset order, the run folder), print the summary,
    and return the exit code (:func:`exit_code`; ``0`` when ``interrupted``: the caller exits
    128 + signal)."""
    results = sink.results
    rows_out = [r.row.model_dump() for r in results]
    wrote = sink.commit()
    extra = {**extra, "status": "interrupted" if interrupted else "finished"}
    if interrupted:
        latch = current_latch()
        name = signal.Signals(latch.first).name if latch is not None and latch.first else "SIGINT"
        extra = {**extra, "interrupted": {"signal": name, "finished": len(results), "rollouts": sink.total}}
        print(f"interrupted by {name}: {len(results)} of {sink.total} rollouts finished")
    if rows_out:
        print(summarize(rows_out))
    if wrote:
        print(f"result rows written to {args.output} (in dataset order)")
    elif args.output:
        print(f"no rollout finished: {args.output} was left as it was")
    save_run(args, results, settings, started, extra)
    if interrupted:
        return EXIT_OK  # the caller exits 128 + signal
    return exit_code(rows_out, settings.max_sub_call_error_rate)


def exit_code(rows: list[dict[str, Any]], max_sub_call_error_rate: float) -> int:
    """The exit code of a finished run from its result rows, saying why on stderr when not 0.

    :data:`EXIT_ROLLOUT_ERRORS` when a rollout ended in ``error``; else
    :data:`EXIT_SUB_CALLS_FAILED` when more than ``max_sub_call_error_rate`` (0..1) of the
    sub-LLM calls of the rollouts' whole trees ended in error (rejections by the budget are not
    errors); else :data:`EXIT_BUDGET_STARVED` when the budget ended a child rollout
    (``budget_spent``) in any tree; else ``0``.
    """
    errors = sum(1 for r in rows if r.get("error"))
    if errors:
        say(f"rlmq: {errors} of {len(rows)} rollouts ended in error (exit code {EXIT_ROLLOUT_ERRORS})")
        return EXIT_ROLLOUT_ERRORS
    whole = tree_totals(rows)
    calls, failed = whole["sub_calls"], whole["sub_failed"]
    if calls and failed / calls > max_sub_call_error_rate:
        what = "all" if failed == calls else f"{failed} of {calls} ({failed / calls:.0%})"
        first = next((r["sub_llm_error"] for r in rows if r.get("sub_llm_error")), None)
        say(
            f"rlmq: {what} sub-LLM calls ended in error, above --max-sub-call-error-rate "
            f"{max_sub_call_error_rate:g}: the answers are not the sub-model's (exit code {EXIT_SUB_CALLS_FAILED})"
            + (f"; the first: {first}" if first else "")
        )
        return EXIT_SUB_CALLS_FAILED
    if whole["budget_spent"]:
        say(
            f"rlmq: the budget starved {whole['starved_rollouts']} of {len(rows)} rollout tree(s): "
            f"{whole['budget_spent']} child rollout(s) ended budget_spent (exit code {EXIT_BUDGET_STARVED})"
        )
        return EXIT_BUDGET_STARVED
    return EXIT_OK
