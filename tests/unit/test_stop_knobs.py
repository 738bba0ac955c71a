"""The knobs of the root loop's stops reach the rollout options from the CLI and RLMEnv."""

from __future__ import annotations

from rlmq.cli.main import _settings, build_parser
from rlmq.common.settings import RolloutOptions
from rlmq.producer.env import RLMEnv


def test_the_cli_flags_reach_the_rollout_options() -> None:
    args = build_parser().parse_args(
        ["run", "d.jsonl", "--base-url", "http://x/v1", "--model", "m", "--max-turns", "0", "--abort-on-code-timeout",
         "--root-context-tokens", "32768", "--context-warning-threshold", "0.5"]
    )  # fmt: skip
    o = _settings(args, "run").rollout_options()
    assert (o.max_turns, o.abort_on_code_timeout, o.root_context_tokens, o.context_warning_threshold) == (
        0, True, 32768, 0.5
    )  # fmt: skip
    plain = _settings(build_parser().parse_args(["run", "d.jsonl", "--base-url", "u", "--model", "m"]), "run")
    defaults = RolloutOptions()
    assert (plain.abort_on_code_timeout, plain.root_context_tokens, plain.context_warning_threshold) == (
        defaults.abort_on_code_timeout, None, 0.8
    )  # fmt: skip
    assert defaults.abort_on_code_timeout is False


def test_the_rlmenv_arguments_reach_the_rollout_options() -> None:
    env = RLMEnv(max_turns=-1, abort_on_code_timeout=True, root_context_tokens=8192, context_warning_threshold=0.9)
    o = env.settings.rollout_options()
    assert (o.max_turns, o.abort_on_code_timeout, o.root_context_tokens, o.context_warning_threshold) == (
        -1, True, 8192, 0.9
    )  # fmt: skip
