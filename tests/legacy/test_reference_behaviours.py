"""Behaviours of verifiers 0.1.14's ``RLMEnv`` that an author observes, end to end through
``rlmq.verifiers_legacy.RLMEnv``: the reference-style module (``envs/needle_reference_rlm.py``)
run by ``Environment.evaluate`` in the verifiers 0.1.14 venv, on real workers, a real Redis and
the scripted model (a test double) behind the recording proxy.

* sub-LLM calls take the rollout's ``sampling_args`` (the reference passes them to every
  sub-call), the per-call cap of rlmq still applying;
* ``include_sub_llm_in_trajectory=True`` puts the reference's sub-LLM steps in
  ``state["trajectory"]`` (``extras["is_sub_llm_call"]``), with the token ids and logprobs the
  model server served, element by element;
* ``root_max_completion_tokens`` as the reference means it: root turns run while the completion
  tokens used are below the limit, no turn capped by it, so ~1,000-token turns under 1,500 give
  two turns, not one;
* ``.messages`` is written without being asked (0.1.14 always wrote it);
* the sub-tools are described in the root model's system message;
* summarization: the root model calls ``summarize_turns``; its later prompts lack the dropped
  turns and carry the ``<SUMMARY>`` block, and the rollout goes on to its answer;
* a cell past ``code_execution_timeout`` with ``abort_on_code_timeout`` ends the rollout with the
  reference's ``RLMCodeExecutionTimeout`` in ``state["error"]``, a class importable from
  ``rlmq.verifiers_legacy`` (the reference's own);
* ``enable_sub_llms=False``: no ``llm_batch`` in the REPL, nothing of sub-LLMs in the prompt;
* the Python REPL's output as the reference's: ``stderr:``, ``Out[n]:``, ``(no output)``;
* a row without a context: the REPL's working directory is empty (no empty ``context.txt``);
* a nested function (a closure) as a sub-tool: the sub-LLM calls it, the rollout's process runs it;
* a module's subclass that overrides a hook (``setup_state``, ``add_model_response``) runs, and
  sees its hooks called.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlmq.scripted.markers import root_call_directive, root_code_directive
from tests.e2e.test_verifiers import proxied_fleet
from tests.legacy.conftest import BUILD_TIMEOUT, legacy_env
from tests.legacy.test_reference_module import Fleet, _rows, evaluate, vf_eval

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(BUILD_TIMEOUT + 600)]  # the first test may build the venv

SAMPLING = {"max_tokens": 700, "temperature": 0.3}
ROOT_LIMIT = 1500
WORDS = 1000
"""Words (the scripted model's tokens) of each root turn's code in the root-limit run."""


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("legacy-behaviour-logs")
    model = "legacy-behaviours"
    with proxied_fleet(redis_url, logs, model) as made:
        yield Fleet(redis_url=redis_url, proxy=made.proxy, model=model)


def _long_turn(k: int) -> str:
    filler = " ".join(f"w{i}" for i in range(WORDS))
    return root_code_directive(f"x = {k}\n# {filler}\n", turn=k)


def _question_rows(path: Path, suffix: str) -> Path:
    return _rows(path, 1, suffix=suffix, min_chars=2_000)


_MESSAGES_CODE = (
    "import json, os\n"
    "lines = open('.messages').read().splitlines() if os.path.exists('.messages') else None\n"
    "msgs = [json.loads(x) for x in lines or []]\n"
    "system = msgs[0]['content'] if msgs else ''\n"
    "told = 'llm_batch tools' in system and 'dumps(obj' in system\n"
    "answer['content'] = json.dumps({'exists': lines is not None, 'roles': [m['role'] for m in msgs], 'told': told})\n"
    "answer['ready'] = True\n"
)


_AGAIN = (
    "n = globals().get('n', 0) + 1\nif n >= 2:\n    answer['content'] = 'after-summary'\n    answer['ready'] = True\n"
)
SUMMARY = "x was set to 1, then 2"


def _summarizing() -> str:
    """Turns 1-3 run cells (the third does nothing the first time), turn 4 calls
    ``summarize_turns(2, ...)``; the model's next prompt then holds two turns, so it runs its
    third-turn code again, which answers."""
    codes = [root_code_directive("x = 1"), root_code_directive("x = 2", turn=2), root_code_directive(_AGAIN, turn=3)]
    call = root_call_directive("summarize_turns", {"n_turns": 2, "summary": SUMMARY}, turn=4)
    return " " + " ".join([*codes, call])


_ALONE_CODE = (
    "import json\n"
    "system = json.loads(open('.messages').readline())['content']\n"
    "seen = {'llm_batch': 'llm_batch' in globals(), 'told': 'llm_batch' in system or 'sub-LLM' in system}\n"
    "answer['content'] = json.dumps(seen)\n"
    "answer['ready'] = True\n"
)
_FORMAT_CELLS = [
    "import sys\nprint('hi')\nprint('careful', file=sys.stderr)\n41 + 1",
    "y = 2",
    "answer['content'] = 'done'\nanswer['ready'] = True",
]
_LISTING_CODE = "import json, os\nanswer['content'] = json.dumps(sorted(os.listdir('.')))\nanswer['ready'] = True\n"
_CLOSURE_PROMPT = '[[mock:tool:add:{"x": 2, "y": 3}]] [[mock:echo-tool-result]] add 2 and 3'
_CLOSURE_CODE = f"answer['content'] = llm_batch([{_CLOSURE_PROMPT!r}])[0]\nanswer['ready'] = True\n"


@pytest.fixture(scope="module")
def runs(legacy: Path, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("legacy-behaviours")
    plain = _question_rows(tmp / "plain.jsonl", "")
    limited = _question_rows(tmp / "limited.jsonl", " " + " ".join(_long_turn(k) for k in (1, 2, 3, 4)))
    history = _question_rows(tmp / "history.jsonl", " " + root_code_directive(_MESSAGES_CODE))
    summarized = _question_rows(tmp / "summarized.jsonl", _summarizing())
    closure = _question_rows(tmp / "closure.jsonl", " " + root_code_directive(_CLOSURE_CODE))
    listing = _question_rows(tmp / "listing.jsonl", " " + root_code_directive(_LISTING_CODE))
    cells = [root_code_directive(c, turn=k) for k, c in enumerate(_FORMAT_CELLS, start=1)]
    formatted = _question_rows(tmp / "formatted.jsonl", " " + " ".join(cells))
    alone = _question_rows(tmp / "alone.jsonl", " " + root_code_directive(_ALONE_CODE))
    slow = _question_rows(tmp / "slow.jsonl", " " + root_code_directive("import time\ntime.sleep(60)"))
    specs: list[dict[str, Any]] = [
        {"rows_path": str(plain), "sampling_args": SAMPLING, "include_sub_llm_in_trajectory": True},
        {"rows_path": str(limited), "root_max_completion_tokens": ROOT_LIMIT},
        {"rows_path": str(history), "sub_tools": ["json:dumps"]},
        {"rows_path": str(plain), "subclass": True},
        {"rows_path": str(summarized), "enable_summarization": True, "min_turns_in_context": 1},
        {"rows_path": str(closure), "closure_sub_tool": True},
        {"rows_path": str(listing), "no_context": True},
        {"rows_path": str(formatted)},
        {"rows_path": str(alone), "enable_sub_llms": False},
        {"rows_path": str(slow), "abort_on_code_timeout": True, "code_execution_timeout": 6},
    ]
    before = len(fleet.proxy.requests())
    outputs = evaluate(legacy, fleet, tmp, specs)
    return {
        "sampled": outputs[0][0],
        "limited": outputs[1][0],
        "history": outputs[2][0],
        "subclass": outputs[3][0],
        "summarized": outputs[4][0],
        "closure": outputs[5][0],
        "no_context": outputs[6][0],
        "formatted": outputs[7][0],
        "alone": outputs[8][0],
        "slow": outputs[9][0],
        "requests": fleet.proxy.requests()[before:],
    }


def _served(fleet: Fleet) -> list[dict[str, Any]]:
    url = fleet.proxy.upstream.removesuffix("/v1") + "/served"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return list(json.loads(resp.read())["served"])


def test_sub_calls_take_the_rollouts_sampling_args(runs: dict[str, Any]) -> None:
    out = runs["sampled"]
    subs = [s for s in runs["requests"] if not s.root and s.user == out["rlmq"]["rollout_id"]]
    assert out["reward"] == 1.0 and len(subs) >= 1, out
    for seen in subs:
        assert seen.params.get("temperature") == SAMPLING["temperature"], seen.params
        assert seen.params.get("max_tokens") == SAMPLING["max_tokens"], seen.params


def test_sub_llm_steps_reach_the_trajectory_with_the_served_tokens(runs: dict[str, Any], fleet: Fleet) -> None:
    out = runs["sampled"]
    steps = out["sub_steps"]
    assert len(steps) >= out["metrics"]["sub_llm_call_count"] >= 1, out["metrics"]
    for step in steps:
        extras = step["extras"]
        assert (
            extras["is_sub_llm_call"] is True
            and step["trajectory_id"] == f"{extras['batch_id']}_{extras['request_id']}"
        )
        assert step["completion_ids"] and len(step["completion_ids"]) == len(step["completion_logprobs"])
    rollout = out["rlmq"]["rollout_id"]
    served = [s for s in _served(fleet) if s.get("user") == rollout and s.get("role") != "root"]
    want = Counter(
        (tuple(s["prompt_token_ids"]), tuple(s["completion_token_ids"]), tuple(s["completion_logprobs"]))
        for s in served
    )
    got = Counter((tuple(s["prompt_ids"]), tuple(s["completion_ids"]), tuple(s["completion_logprobs"])) for s in steps)
    assert got == want and sum(want.values()) == len(steps)


def test_root_turns_run_while_the_root_limit_is_not_reached(runs: dict[str, Any]) -> None:
    out = runs["limited"]
    turns = out["root_turn_completion_tokens"]
    assert len(turns) == 2 and all(t > WORDS for t in turns), turns  # not cut to what was left
    assert turns[0] < ROOT_LIMIT <= sum(turns)
    assert out["stop_condition"] == "has_final_env_response", out


def test_the_message_history_is_written_without_being_asked(runs: dict[str, Any]) -> None:
    seen = json.loads(runs["history"]["final_answer"])
    assert seen["exists"] is True and seen["roles"][:2] == ["system", "user"], seen


def test_the_sub_tools_are_described_in_the_root_prompt(runs: dict[str, Any]) -> None:
    """The reference tells the root model what the sub-LLMs can call (its ``llm_batch`` tools
    section): here the system message lists ``json.dumps`` with its signature."""
    assert json.loads(runs["history"]["final_answer"])["told"] is True


def test_a_subclass_that_overrides_hooks_runs_and_sees_them_called(runs: dict[str, Any]) -> None:
    out = runs["subclass"]
    assert out["reward"] == 1.0 and out["error"] is None, out
    hooks = out["hooks"]
    assert hooks["setup_state"] == 1 and hooks["add_model_response"] == out["metrics"]["root_llm_turns"] >= 1


def test_summarize_turns_drops_turns_from_the_prompt_and_the_rollout_goes_on(runs: dict[str, Any]) -> None:
    out = runs["summarized"]
    assert out["final_answer"] == "after-summary" and out["stop_condition"] == "answer_ready", out
    m = out["metrics"]
    assert m["summarize_count"] == 1 and m["summarize_total_turns_dropped"] == 2, m
    prompts = [p["assistants"] for p in out["root_prompts"]]
    assert [len(p) for p in prompts] == [0, 1, 2, 3, 2], prompts  # the 5th call: turns 3 and 4 only
    assert prompts[-1][0].startswith(f"<SUMMARY>\n[Turns 1-2] {SUMMARY}\n</SUMMARY>"), prompts[-1]
    assert not any("<SUMMARY>" in text for p in prompts[:-1] for text in p)


def test_a_closure_sub_tool_is_called_by_the_sub_llm_and_run_by_the_rollout(runs: dict[str, Any]) -> None:
    out = runs["closure"]
    assert out["error"] is None and "tool result: 5" in out["final_answer"], out


def test_a_row_without_a_context_gets_an_empty_working_directory(runs: dict[str, Any]) -> None:
    listed = json.loads(runs["no_context"]["final_answer"])
    assert [name for name in listed if name != ".messages"] == [], listed  # .messages: written before each cell


def test_the_python_repl_output_reads_as_the_references(runs: dict[str, Any]) -> None:
    out = runs["formatted"]
    assert out["final_answer"] == "done", out
    tools = out["root_prompts"][-1]["tools"]  # the last root call saw both cells' outputs
    assert tools[0] == "hi\nstderr:\ncareful\nOut[1]: 42\n" and tools[1] == "(no output)", tools


def test_without_sub_llms_the_repl_and_the_prompt_have_none(runs: dict[str, Any]) -> None:
    out = runs["alone"]
    assert json.loads(out["final_answer"]) == {"llm_batch": False, "told": False}, out
    assert out["metrics"]["sub_llm_call_count"] == 0


def test_an_aborted_cell_ends_the_rollout_with_the_references_error(runs: dict[str, Any], legacy: Path) -> None:
    out = runs["slow"]
    assert out["stop_condition"] == "has_error" and out["error"]["error"] == "RLMCodeExecutionTimeout", out
    check = (
        "import rlmq.verifiers_legacy as ours\n"
        "from verifiers.envs.experimental import rlm_env as ref\n"
        "names = ['RLMCodeExecutionTimeout', 'RLMSessionError', 'RLMSetupError', 'RLMWorkerError',\n"
        "         'RLMWorkerRecoveryError', 'SubLLMEmptyModelResponseError']\n"
        "assert all(getattr(ours, n) is getattr(ref, n) for n in names)\n"
    )
    proc = subprocess.run([str(legacy), "-c", check], env=legacy_env({}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_vf_eval_saves_the_sub_llm_steps(legacy: Path, fleet: Fleet, tmp_path: Path) -> None:
    """verifiers 0.1.14's ``vf-eval`` with ``include_sub_llm_in_trajectory``: the saved
    ``trajectory`` column holds the sub-LLM steps, with their token ids and logprobs."""
    rows = _question_rows(tmp_path / "rows.jsonl", "")
    args = {"rows_path": str(rows), "include_sub_llm_in_trajectory": True}
    (row,) = vf_eval(legacy, fleet, tmp_path, args, 1, ("-C", "final_answer,rlmq,trajectory"))
    subs = [s for s in row["trajectory"] if (s.get("extras") or {}).get("is_sub_llm_call")]
    assert row["reward"] == 1.0 and len(subs) >= row["sub_llm_call_count"] >= 1, row
    for step in subs:
        tokens = step["tokens"]
        assert tokens["completion_ids"] and len(tokens["completion_ids"]) == len(tokens["completion_logprobs"])


def test_the_directive_code_is_base64() -> None:
    """The root-limit rows carry their code as the scripted model's directive (a test of the test)."""
    code = base64.b64decode(_long_turn(2).split(":", 2)[2].rstrip("]")).decode()
    assert code.startswith("x = 2") and len(code.split()) > WORDS
