"""docs/verifiers-rlmenv.md's table of shared names against the code: every argument, metric,
state key and stop reason of verifiers' RLMEnv (0.1.14) and of rlmq has a row; a difference says
why; an argument marked ``same`` has the reference's default as rlmq's declared default."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path
from typing import Any

from rlmq.common.schemas import ResultRow, StopReason
from rlmq.common.settings import RolloutOptions, setting_default
from rlmq.producer.env import _OVERRIDABLE, RLMEnv
from rlmq.producer.rollout import RolloutStats

DOC = Path(__file__).resolve().parents[2] / "docs" / "verifiers-rlmenv.md"

# verifiers 0.1.14, verifiers/envs/experimental/rlm_env.py: RLMEnv.__init__'s arguments and defaults
# (expose_message_history: 0.1.11's, the last release with it); names and values only.
REFERENCE_ARGUMENTS: dict[str, Any] = {
    "max_turns": 50, "tools": None, "root_tools": None, "sub_tools": None, "sub_llm_max_turns": 5,
    "sub_max_completion_tokens": None, "root_max_completion_tokens": None, "sub_model": None,
    "sub_prompt_verbosity": "light", "root_prompt_verbosity": "light", "enable_sub_llms": True,
    "enable_summarization": False, "min_turns_in_context": 3, "max_turns_in_context": None,
    "max_output_length": 8192, "max_sub_llm_parallelism": 5, "system_prompt": None, "repl_language": "bash",
    "pip_install_packages": "", "include_sub_llm_in_trajectory": False, "context_warning_threshold": 0.80,
    "max_startup_wait_seconds": 120, "code_execution_timeout": 120, "abort_on_code_timeout": False,
    "retain_filesystem_after_rollout": False, "expose_message_history": False,
    "sandbox_docker_image": "python:3.11-slim", "sandbox_cpu_cores": 1, "sandbox_memory_gb": 2,
    "sandbox_disk_size_gb": 5, "sandbox_gpu_count": 0, "sandbox_timeout_minutes": 60,
    "sandbox_environment_vars": None, "sandbox_labels": None, "sandbox_client_max_workers": 50,
    "sandbox_client_max_connections": 100, "sandbox_client_max_keepalive_connections": 50,
    "sandbox_transfer_max_retries": 3,
}  # fmt: skip
# RLMMonitorRubric._SIMPLE_METRICS
REFERENCE_METRICS = [
    "sub_llm_call_count", "sub_llm_total_turns", "sub_llm_prompt_tokens", "sub_llm_completion_tokens",
    "sub_llm_total_tool_calls", "sub_llm_batch_count", "sub_llm_max_batch_size", "sub_llm_mean_batch_size",
    "root_llm_turns", "root_llm_prompt_tokens", "root_llm_completion_tokens", "repl_total_time_seconds",
    "repl_call_count", "repl_mean_time_seconds", "root_tool_call_count", "llm_batch_mean_time_seconds",
    "root_tool_non_llm_mean_time_seconds", "sub_llm_max_turns_reached_frac", "max_turns_in_context_stopped",
    "summarize_count", "summarize_rejected_count", "summarize_total_turns_dropped", "summarize_total_chars_dropped",
    "summarize_summary_length_chars", "summarize_char_compression_ratio", "summarize_mean_turns_per_call",
    "summarize_mean_remaining_turns", "summarize_mean_turns_between",
]  # fmt: skip
# its @vf.stop methods and those of its base environment
REFERENCE_STOPS = [
    "answer_ready", "max_turns_reached", "no_tools_called", "prompt_too_long", "has_error",
    "max_total_completion_tokens_reached", "has_final_env_response",
]  # fmt: skip
REFERENCE_STATE = ["final_answer", "rlm_fs_root", "rlm_fs_source", "rlm_fs_has_data", "context_warning_sent"]
STATUSES = {"same", "different", "reference only", "rlmq only"}


TABLE_HEADING = "## Every shared name, row by row"


def rows() -> list[dict[str, str]]:
    """The rows of the table under :data:`TABLE_HEADING` (up to the next ``## `` heading)."""
    text = DOC.read_text(encoding="utf-8")
    assert TABLE_HEADING in text
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("argument", "metric", "state", "stop"):
            assert len(cells) == 6, line
            out.append(dict(zip(("kind", "name", "reference", "rlmq", "status", "why"), cells, strict=True)))
    return out


def names(kind: str) -> list[str]:
    return [r["name"] for r in rows() if r["kind"] == kind]


def test_every_row_has_a_known_status_and_a_difference_says_why() -> None:
    table = rows()
    assert len(table) > 100
    for r in table:
        assert r["status"] in STATUSES, r
        if r["status"] in ("different", "reference only"):
            assert r["why"], f"{r['kind']} {r['name']}: a difference with no reason"
    for kind in ("argument", "metric", "state", "stop"):
        dupes = {n for n in names(kind) if names(kind).count(n) > 1}
        assert not dupes, (kind, dupes)


def test_every_argument_of_both_sides_has_a_row() -> None:
    ours = set(_OVERRIDABLE) | {"tools", "root_tools"}
    assert set(inspect.signature(RLMEnv.__init__).parameters) >= ours
    missing = (ours | set(REFERENCE_ARGUMENTS)) - set(names("argument"))
    assert not missing, f"no row in docs/verifiers-rlmenv.md for argument(s) {sorted(missing)}"
    extra = set(names("argument")) - ours - set(REFERENCE_ARGUMENTS)
    assert not extra, f"rows for arguments neither side has: {sorted(extra)}"


def test_an_argument_marked_same_has_the_references_default() -> None:
    signature = inspect.signature(RLMEnv.__init__).parameters
    for r in rows():
        if r["kind"] != "argument" or r["status"] != "same":
            continue
        name = r["name"]
        assert name in REFERENCE_ARGUMENTS and name in signature, name
        ref = REFERENCE_ARGUMENTS[name]
        if name in ("tools", "root_tools"):  # callables: None means none on both sides
            assert ref is None and signature[name].default is None
            continue
        # the reference's default, read through rlmq's declaration, is rlmq's default
        as_ours = getattr(RolloutOptions.model_validate({name: ref}), name)
        assert as_ours == setting_default(name), f"{name}: reference {ref!r} is not rlmq's {setting_default(name)!r}"


def test_an_argument_rlmq_does_not_take_is_not_marked_shared() -> None:
    ours = set(_OVERRIDABLE) | {"tools", "root_tools"}
    for r in rows():
        if r["kind"] == "argument" and r["name"] not in ours:
            assert r["status"] in ("reference only", "different"), r
        if r["kind"] == "argument" and r["name"] not in REFERENCE_ARGUMENTS:
            assert r["status"] in ("rlmq only", "different"), r


def test_every_metric_state_key_and_stop_reason_has_a_row() -> None:
    metrics = set(RolloutStats().metrics())
    assert not (metrics | set(REFERENCE_METRICS)) - set(names("metric")), sorted(
        (metrics | set(REFERENCE_METRICS)) - set(names("metric"))
    )
    for name in REFERENCE_METRICS:
        row = next(r for r in rows() if r["kind"] == "metric" and r["name"] == name)
        assert (row["status"] == "reference only") == (name not in metrics), row
    state = set(ResultRow.model_fields) | set(REFERENCE_STATE)
    assert not state - set(names("state")), sorted(state - set(names("state")))
    stops = set(typing.get_args(StopReason))
    assert not stops - set(names("stop")), sorted(stops - set(names("stop")))
    stop_text = " ".join(r["reference"] + " " + r["name"] for r in rows() if r["kind"] == "stop")
    for name in REFERENCE_STOPS:
        assert re.search(rf"\b{name}\b", stop_text), f"the reference's stop {name} has no row"
