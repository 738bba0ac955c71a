"""Every ``rlmq run`` flag, driven through the real command line, with its effect on the rollouts.

Two ``rlmq run`` processes run at once against two scripted model servers (one answers the
root model, one the sub-LLMs, so the test sees which server each call reached):

* run A uses the session's embedded Redis (``--redis-url``) and one ``rlmq worker`` the test
  starts on a custom ``--queue``; its rows each show one limit at work (turns taken, output
  cut, cell timeout, sub-call deadline, budget, parallelism, root token limit), its job
  records in Redis show what each sub-call was asked to do, and its Prometheus endpoint is
  scraped while it runs.
* run B starts its own embedded Redis and ``--workers 1`` local worker calling
  ``--sub-base-url``, with ``--concurrency 1`` and the progress bar on.

A flag of ``rlmq run`` that neither run passes fails the test: a new flag needs a row here.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from rlmq.cli.local import ProcessGroup, child_env, rlmq_command, start_mock_llm
from rlmq.cli.main import build_parser
from rlmq.common import keys as K
from rlmq.common.jobs.record import decode_job_data
from rlmq.producer.scaffold import files_text, root_system_prompt, sub_system_prompt
from rlmq.scripted.server import root_code_directive
from tests.e2e.test_signals import as_from_a_terminal

pytestmark = pytest.mark.e2e

RUN_DEADLINE = 240.0
"""Seconds either run may take on a loaded 2-core machine (it takes about 15)."""

SECRET = "sk-structure-test-secret-4711"
FLAGS_A: dict[str, str | None] = {
    "--max-turns": "3",
    "--sub-llm-max-turns": "2",
    "--max-output-length": "500",
    "--code-execution-timeout": "10",
    "--abort-on-code-timeout": None,
    "--root-context-tokens": "1000",
    "--context-warning-threshold": "0.05",
    "--root-prompt-verbosity": "heavy",
    "--sub-prompt-verbosity": "heavy",
    "--sub-llm-max-completion-tokens": "60",
    "--sub-llm-per-call-max-tokens": "20",
    "--root-max-completion-tokens": "300",
    "--max-tokens": "100",  # a root turn's max_tokens: whole turns of 100 under the root budget of 300
    "--max-sub-llm-parallelism": "2",
    "--sub-call-timeout": "4",
    "--concurrency": "3",
    "--api-key": SECRET,
    "--metrics-port": "0",
    "--metrics-host": "127.0.0.1",
    "--quiet": None,
    "--max-batch-prompts": "6",
    "--max-batch-bytes": "200000",
    "--rollout-key-ttl": "600",
    "--include-sub-llm-in-trajectory": None,
    "--trajectory-token-max-bytes": "1",  # every turn's tokens are past it: kept untrainable (payload_cap)
    "--rollout-timeout": "900",
    "--max-startup-wait-seconds": "90",
    "--sub-llm-final-answer-turn": None,
    "--max-sub-call-error-rate": "0.5",  # one deadline error among its sub-calls: still exit 0
    "--preflight-timeout": "30",  # the check before the rollouts finds its worker
}
FLAGS_B: dict[str, str | None] = {
    "--num-examples": "2",  # ROWS_B has three rows
    "--sampling-args": '{"extra_body": {"top_k": 5}, "max_tokens": 4000}',
    "--temperature": "0.4",
    "--top-p": "0.9",
    "--max-tokens": "3000",  # over --sampling-args
    "--sub-sampling-args": '{"min_p": 0.2, "top_p": 0.1}',
    "--sub-temperature": "0.3",
    "--sub-top-p": "0.7",  # over --sub-sampling-args
}
TESTED_ELSEWHERE = {
    "--resume": "tests/e2e/test_eval_knobs.py",
    "--rollouts-per-example": "tests/e2e/test_eval_knobs.py",
    "--no-preflight": "tests/e2e/test_cli_errors.py (and test_preflight.py for the check itself)",
    "--preflight": "the default: tests/e2e/test_preflight.py",
    "--allow-evicting-redis": "tests/fleet/test_conditions.py (rlmq run against an evicting Redis, with and without)",
    "--no-allow-evicting-redis": "the default: tests/fleet/test_conditions.py (refused)",
    "--repl-language": "tests/e2e/test_bash_repl.py (rlmq run --repl-language bash, a child rollout in bash)",
    "--expose-message-history": "tests/e2e/test_bash_repl.py (the same setting through RLMEnv)",
    "--retain-filesystem-after-rollout": "tests/e2e/test_bash_repl.py (the same setting through RLMEnv)",
    "--token-ids-api": "tests/e2e/test_token_servers_e2e.py (rlmq run --token-ids-api sglang: root turns as served)",
    "--weight-versions": "tests/e2e/test_token_servers_e2e.py (spans on every turn, into the samples)",
    "--redis-replica-acks": "tests/fleet/test_replica_acks.py (grants wait for a replica behind Sentinel)",
    "--redis-replica-ack-timeout": "tests/integration/test_replica_ack_policy.py (a grant no replica acknowledged)",
    "--sub-tool-max-result-chars": "tests/faults/test_tool_flood.py (a 52 MB tool error cut before it travels)",
    "--no-weight-versions": "the default: tests/unit/test_token_servers.py (nothing asked or carried)",
    "--enable-sub-llms": "the default: every rollout of these tests has sub-LLMs",
    "--no-enable-sub-llms": "tests/legacy/test_reference_behaviours.py (the same setting through the legacy RLMEnv)",
    "--repl-output-format": "tests/legacy/test_reference_behaviours.py (the same setting through the legacy RLMEnv)",
}


def question(text: str, *codes: str) -> str:
    """A question whose root turns 1, 2, ... run exactly ``codes``."""
    return text + " " + " ".join(root_code_directive(c, turn=i + 1) for i, c in enumerate(codes))


ROWS_A = [
    # five turns of code, no answer: --max-turns 3 stops it after three
    {"id": "turns", "context": "c", "question": question("Turns?", *(f"print({k})" for k in range(1, 6)))},
    # 2,000 characters printed: --max-output-length 500 cuts them
    {"id": "cut", "context": "c", "question": question("Cut?", "print('x' * 2000)")},
    # a cell that would sleep two minutes: --code-execution-timeout 10 ends it, and with it the
    # rollout (--abort-on-code-timeout)
    {"id": "timeout", "context": "c", "question": question("Timeout?", "import time\ntime.sleep(120)")},
    # a sub-LLM that answers after 8 s: --sub-call-timeout 4 gives it a deadline error
    {"id": "deadline", "context": "c", "question": question("Deadline?", "out = llm_batch(['[[mock:sleep:8]] slow'])")},
    # six calls that spend all they are granted, then one more batch: the budget of 60 holds
    {
        "id": "budget",
        "context": "c",
        "question": question(
            "Budget?", "out = llm_batch([f'[[mock:spend-all]] call {i}' for i in range(6)])", "llm_batch(['again'])"
        ),
    },
    # six quick calls with --max-sub-llm-parallelism 2
    {
        "id": "parallel",
        "context": "c",
        "question": question("Parallel?", "out = llm_batch([f'p{i}' for i in range(6)])"),
    },
    # a 400-word first turn: --root-max-completion-tokens 300 cuts the root's reply
    {"id": "rootcap", "context": "c", "question": question("Cap?", "x = '" + " ".join(["w"] * 400) + "'")},
    # 7 prompts, then 300,000 bytes: --max-batch-prompts 6 and --max-batch-bytes 200000 refuse them
    {
        "id": "batchcap",
        "context": "c",
        "question": question(
            "Batch cap?",
            "for args in (['x'] * 7, ['y' * 300000]):\n    try:\n        llm_batch(args)\n"
            "    except Exception as exc:\n        print('refused:', exc)",
        ),
    },
]

CELL_B = (
    "import time\nt0 = time.time()\nout = llm_batch([f'b{i}' for i in range(4)])\ntime.sleep(1.0)\n"
    "import rlmqtoy\nprint('toy', rlmqtoy.VALUE, 'words', count_words('a b c'), dumps([1]))\n"
    "try:\n    dumps(['x' * 3000])\nexcept ValueError as exc:\n    print('refused:', exc)\n"
    "answer['content'] = f'{t0} {time.time()}'\nanswer['ready'] = True"
)
SYSTEM_B = "You are run B's own system prompt."


def toy_wheel(folder: Path) -> Path:
    """A one-module wheel (``rlmqtoy``, ``VALUE = 7``) for --pip-install-packages, built by hand."""
    import zipfile

    path = folder / "rlmqtoy-0.1-py3-none-any.whl"
    info = "rlmqtoy-0.1.dist-info"
    files = {
        "rlmqtoy.py": "VALUE = 7\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: rlmqtoy\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rlmq-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


ROWS_B = [{"id": f"b{i}", "context": "c", "question": question(f"B{i}?", CELL_B)} for i in range(3)]


class Run:
    """One ``rlmq run`` subprocess with its stdout and stderr read by threads (no pipe fills up)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env({"PYTHONUNBUFFERED": "1"}),
            start_new_session=True,
            preexec_fn=as_from_a_terminal(),  # stop() sends SIGINT: not ignored, whatever pytest inherited
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.metrics_url: str | None = None
        self.metrics_seen = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, pipe: Any, into: list[str]) -> None:
        for raw in pipe:
            line = raw.decode(errors="replace")
            into.append(line)
            if line.startswith("metrics: http://"):
                self.metrics_url = line.split(" ", 1)[1].strip()
                self.metrics_seen.set()

    def wait(self) -> int:
        try:
            code = self.proc.wait(timeout=RUN_DEADLINE)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"rlmq run did not finish within {RUN_DEADLINE:g} s; stderr: {''.join(self.err)[-2000:]}")
        for t in self._threads:
            t.join(10)
        return code

    def stop(self) -> None:
        """Ctrl-C (so the run stops the workers and Redis it started), then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_flags() -> set[str]:
    """Every long option of ``rlmq run``, from the real parser."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for action in sub.choices["run"]._actions for o in action.option_strings if o.startswith("--")}


def option_strings(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def test_every_run_flag_reaches_the_rollout(real_redis: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    root_a, sub_a, root_b, sub_b = f"root-a-{tag}", f"sub-a-{tag}", f"root-b-{tag}", f"sub-b-{tag}"
    queue, tenant = f"flags-{tag}", "tenant7"
    group = ProcessGroup(str(tmp_path / "logs"))
    runs: list[Run] = []
    try:
        root_url = start_mock_llm(group)
        sub_url = start_mock_llm(group)
        # run A's worker: the custom queue, the sub-LLM server
        group.spawn(
            rlmq_command("worker", "--base-url", sub_url, "--model", sub_a, "--queue", queue, "--concurrency", "32"),
            "worker-a",
            env=child_env({"RLMQ_REDIS_URL": redis_url}),
        )
        deadline = time.monotonic() + 60
        while real_redis.scard(K.rq_workers_of_queue(queue)) < 1:
            assert time.monotonic() < deadline, "the worker did not register within 60 s"
            assert all(p.poll() is None for p in group.procs), "a child process died while starting"
            time.sleep(0.05)  # polling another process's registration, bounded by the deadline

        dir_a, dir_b = tmp_path / "run-a", tmp_path / "run-b"
        argv_a = [
            "run", str(write_rows(tmp_path / "a.jsonl", ROWS_A)), "--base-url", root_url, "--model", root_a,
            "--sub-model", sub_a, "--redis-url", redis_url, "--queue", queue, "--tenant", tenant,
            "--output", str(tmp_path / "a-out.jsonl"), "--run-dir", str(dir_a),
        ]  # fmt: skip
        for flag, value in FLAGS_A.items():
            argv_a += [flag] if value is None else [flag, value]
        argv_b = [
            "run", str(write_rows(tmp_path / "b.jsonl", ROWS_B)), "--base-url", root_url, "--model", root_b,
            "--sub-model", sub_b, "--sub-base-url", sub_url, "--workers", "1", "--concurrency", "1",
            "--run-dir", str(dir_b), "--sub-tool", "rlmq.workers.tools.count_words", "--verbose",
            "--tool", "rlmq.workers.tools:count_words", "--root-tool", "json:dumps", "--root-tool-timeout", "30",
            "--hosted-tool-timeout", "45",
            "--root-tool-max-args-bytes", "2048", "--root-tool-max-result-bytes", "1500",
            "--system-prompt", SYSTEM_B, "--system-prompt-mode", "append", "--no-sub-llm-final-answer-turn",
            "--max-startup-wait-seconds", "200", "--pip-install-packages", str(toy_wheel(tmp_path)),
            "--no-include-sub-llm-in-trajectory", "--no-abort-on-code-timeout", "--max-depth", "2",
            "--child-root-min-grant-tokens", "300", "--root-model-timeout", "300",
            "--no-expose-message-history", "--no-retain-filesystem-after-rollout",
        ]  # fmt: skip
        for flag, value in FLAGS_B.items():
            argv_b += [flag] if value is None else [flag, value]
        # --sub-tool and --verbose ride along here (the run must still succeed with them); what
        # each does is asserted in tests/e2e/test_cli_errors.py (the tool offered to the sub-LLM
        # and allowed on the local workers; the traceback of an error shown).
        # Every flag of `rlmq run` is exercised by one of the runs.
        missing = run_flags() - {"--help"} - option_strings(argv_a) - option_strings(argv_b) - set(TESTED_ELSEWHERE)
        assert not missing, f"flags of `rlmq run` this test does not drive: {sorted(missing)}"

        run_a = Run(rlmq_command(*argv_a))
        runs.append(run_a)
        run_b = Run(rlmq_command(*argv_b))
        runs.append(run_b)
        # --metrics-port 0 / --metrics-host: the exporter serves while the run runs
        assert run_a.metrics_seen.wait(RUN_DEADLINE), "".join(run_a.err)[-2000:]
        assert run_a.metrics_url is not None and run_a.metrics_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(run_a.metrics_url, timeout=10) as resp:
            assert b"rlmq_" in resp.read()
        code_a, code_b = run_a.wait(), run_b.wait()
        assert code_a == 0, "".join(run_a.err)[-3000:]
        assert code_b == 0, "".join(run_b.err)[-3000:]
        check_run_a(real_redis, dir_a, tmp_path / "a-out.jsonl", run_a, queue=queue, tenant=tenant, sub=sub_a)
        check_run_b(dir_b, run_b)
        # --base-url / --model / --sub-model / --sub-base-url: each call reached the server it names
        root_stats, sub_stats = server_stats(root_url), server_stats(sub_url)
        assert set(root_stats["per_model"]) == {root_a, root_b}
        assert set(sub_stats["per_model"]) == {sub_a, sub_b}
        assert root_stats["per_model"][root_a]["requests"] == 3 + 2 + 1 + 2 + 3 + 2 + 1 + 2  # root turns of ROWS_A
        # run B: 2 rows x 4 prompts, each answered once (the message: requests per rollout)
        per_rollout = collections.Counter(p.get("user") for p in sub_stats["params"] if p["model"] == sub_b)
        assert sub_stats["per_model"][sub_b]["completions"] == 8, per_rollout
        # --sampling-args / --temperature / --top-p / --max-tokens, and the --sub-* ones: in every request
        root_b_params = [p for p in root_stats["params"] if p["model"] == root_b]
        sub_b_params = [p for p in sub_stats["params"] if p["model"] == sub_b]
        assert len(root_b_params) == 2 and len(sub_b_params) == 8
        for p in root_b_params:
            assert (p["top_k"], p["temperature"], p["top_p"], p["max_tokens"]) == (5, 0.4, 0.9, 3000), p
        for p in sub_b_params:  # the --sub-* ones over the root's, which sub-calls inherit otherwise
            got = (p["min_p"], p["temperature"], p["top_p"], p["top_k"], p["max_tokens"])
            assert got == (0.2, 0.3, 0.7, 5, 3000), p
    finally:
        for run in runs:
            run.stop()
        group.stop()


def check_run_a(r: redis.Redis, folder: Path, output: Path, run: Run, *, queue: str, tenant: str, sub: str) -> None:
    rows = {row["id"]: row for row in read_jsonl(folder / "rows.jsonl")}
    traj = {t["id"]: t for t in read_jsonl(folder / "trajectories.jsonl")}
    # --run-dir: the folder's files; dataset: every row, in the dataset's order
    assert {p.name for p in folder.iterdir()} >= {"rows.jsonl", "trajectories.jsonl", "meta.json", "report.html"}
    assert list(rows) == [row["id"] for row in ROWS_A]
    # --output: the same result rows (in the order they finished)
    assert sorted(json.dumps(x, sort_keys=True) for x in read_jsonl(output)) == sorted(
        json.dumps(x, sort_keys=True) for x in rows.values()
    )
    assert all(row["stop_reason"] not in ("error", "prompt_too_long") for row in rows.values()), rows
    # --max-turns 3
    assert rows["turns"]["stop_reason"] == "max_turns" and rows["turns"]["metrics"]["main_rlm_turns"] == 3
    # --max-output-length 500
    cut = next(e for e in traj["cut"]["trajectory"] if e["type"] == "cell")["output"]
    assert cut.startswith("x" * 500 + "...\n[output truncated: 1501 more characters]")  # 2,000 x and a newline
    # --code-execution-timeout 10 / --abort-on-code-timeout
    cell = next(e for e in traj["timeout"]["trajectory"] if e["type"] == "cell")
    assert cell["timed_out"] and 9 <= cell["seconds"] < 60
    assert rows["timeout"]["stop_reason"] == "code_timeout" and rows["timeout"]["metrics"]["main_rlm_turns"] == 1
    # --root-context-tokens 1000 / --context-warning-threshold 0.05: the first reply's prompt (the
    # heavy scaffold) passes 50 tokens, so the first tool message warns, and only that one
    tools = [m["content"] for m in traj["turns"]["messages"] if m["role"] == "tool"]
    assert ["of your 1,000-token context" in t for t in tools] == [True, False, False], tools
    # --sub-call-timeout 4
    batch = next(e for e in traj["deadline"]["trajectory"] if e["type"] == "llm_batch")
    # (the producer's deadline result or the worker's own, whichever came first; both say "deadline")
    assert [(x["status"], x["error_kind"]) for x in batch["results"]] == [("error", "deadline")]
    raw = r.hget(K.rq_job(batch["results"][0]["job_id"]), "data")
    assert isinstance(raw, bytes)
    late = decode_job_data(raw)[1][0]
    assert late["deadline"] - late["enqueued_at"] == pytest.approx(4.0)
    # --sub-llm-max-completion-tokens 60 / --sub-llm-per-call-max-tokens 20
    m = rows["budget"]["metrics"]
    assert m["sub_llm_budget_limit"] == 60 and 0 < m["sub_llm_completion_tokens"] <= 60
    first, second = [e for e in traj["budget"]["trajectory"] if e["type"] == "llm_batch"]
    assert all(x["completion_tokens"] <= 20 for x in first["results"])
    cells = [e["output"] for e in traj["budget"]["trajectory"] if e["type"] == "cell"]
    assert "/60 sub-LLM completion tokens used]" in cells[0]
    if m["sub_llm_completion_tokens"] == 60:
        assert second["results"][0]["status"] == "rejected"
    # --root-max-completion-tokens 300 with --max-tokens 100: the 400-word reply was cut at its
    # turn's whole 100 (never at what was left of the budget), and the rollout stopped
    assert rows["rootcap"]["metrics"]["main_rlm_completion_tokens"] == 100
    assert rows["rootcap"]["stop_reason"] == "no_tool_call"
    # --root-prompt-verbosity heavy (and the limits the scaffold states)
    for row in ROWS_A:
        system = traj[row["id"]]["messages"][0]["content"]
        assert system == root_system_prompt(
            row["context"], verbosity="heavy", budget=60, max_turns=3, sub_llm_max_turns=2,
            max_output_length=500, parallelism=2, root_budget=300, root_turn_tokens=100,
            files=files_text("context.txt"),
        )  # fmt: skip
        assert traj[row["id"]]["messages"][1]["content"] == row["question"]
    # --max-batch-prompts 6 / --max-batch-bytes 200000: the REPL refused both batches
    out = next(e for e in traj["batchcap"]["trajectory"] if e["type"] == "cell")["output"]
    assert "llm_batch got 7 prompts; at most 6 per call" in out, out
    assert "at most 200000 per call" in out, out
    # --include-sub-llm-in-trajectory: each sub-LLM's own conversation is kept
    par_results = next(e for e in traj["parallel"]["trajectory"] if e["type"] == "llm_batch")["results"]
    assert all(x.get("messages") for x in par_results), par_results
    # ...and every turn of it is a step, here past --trajectory-token-max-bytes 1: kept, untrainable
    steps = [t for x in par_results for t in x["steps"]]
    assert steps and all(t["untrainable_reason"] == "payload_cap" for t in steps), par_results
    assert traj["parallel"]["trajectory"][0]["untrainable_reason"] == "payload_cap"  # its root turn too
    # --rollout-key-ttl 600: the rollouts' keys expire within 600 s (the default is 3600)
    infos = [k for k in r.scan_iter(match="rlmq:*info*") if b"{" in k]
    assert infos and all(0 < r.ttl(k) <= 600 for k in infos), [(k, r.ttl(k)) for k in infos]
    # --rollout-timeout, --max-startup-wait-seconds (no effect these rows can show: it takes a rollout
    # running for minutes): the values the run recorded as its rollouts' settings (the budget's included)
    recorded = json.loads((folder / "meta.json").read_text(encoding="utf-8"))["settings"]
    assert (recorded["rollout_timeout"], recorded["max_startup_wait_seconds"]) == (900, 90)
    assert (recorded["sub_llm_per_call_max_tokens"], recorded["sub_llm_max_completion_tokens"]) == (20, 60)
    # What each sub-call was asked to do, from its RQ job record in Redis
    par = next(e for e in traj["parallel"]["trajectory"] if e["type"] == "llm_batch")
    assert [x["status"] for x in par["results"]] == ["ok"] * 6
    requests = []
    for x in par["results"]:
        job = r.hgetall(K.rq_job(x["job_id"]))
        # --queue / --tenant: the job went to <queue>@<tenant>
        assert job[b"origin"].decode() == f"{queue}@{tenant}"
        requests.append(decode_job_data(job[b"data"])[1][0])
    for req in requests:
        assert req["model"] == sub  # --sub-model
        assert req["max_turns"] == 2  # --sub-llm-max-turns
        assert req["system_prompt"] == sub_system_prompt("heavy")  # --sub-prompt-verbosity
        assert req["max_completion_tokens"] == 20 and req["budgeted"] is True
        assert req.get("final_answer_turn", True) is True  # --sub-llm-final-answer-turn (the default)
        assert req["deadline"] - req["enqueued_at"] == pytest.approx(4.0)
    # --max-sub-llm-parallelism 2: two jobs enqueued at first, the rest as results came back
    first_wave = min(req["enqueued_at"] for req in requests)
    assert sum(1 for req in requests if req["enqueued_at"] == first_wave) == 2
    # --quiet: no progress bar; --api-key: sent, never written down
    stderr = "".join(run.err)
    assert "rollouts:" not in stderr
    everything = "".join(run.out) + stderr + "".join(p.read_text(encoding="utf-8") for p in folder.iterdir())
    assert SECRET not in everything
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    assert "--api-key" in meta["command"] and "***" in meta["command"]


def check_run_b(folder: Path, run: Run) -> None:
    rows = read_jsonl(folder / "rows.jsonl")
    for t in read_jsonl(folder / "trajectories.jsonl"):
        cell = next(e["output"] for e in t["trajectory"] if e["type"] == "cell")
        # --pip-install-packages / --tool / --root-tool: the wheel imports, both tools are REPL globals
        assert "toy 7 words 3 [1]" in cell, cell
        # --root-tool-max-args-bytes 2048: the stub refuses 3,000 characters of arguments
        assert "refused: dumps() arguments take" in cell and "at most 2048" in cell, cell
        # --system-prompt with --system-prompt-mode append: after the scaffold's text
        system = t["messages"][0]["content"]
        assert system.endswith("\n\n" + SYSTEM_B) and system.startswith("You are answering"), system
        assert "`dumps(obj, *" in system and "`count_words(text: str) -> int`" in system
        # --max-depth 2: the top rollout is told of rlm_batch and its child RLMs
        assert "`rlm_batch(tasks: list) -> list[str]`" in system and "depth 1 of 2" in system, system
    assert [row["stop_reason"] for row in rows] == ["answer_ready", "answer_ready"], rows
    for row in rows:
        assert row["metrics"]["count_words_root_calls"] == 1 and row["metrics"]["dumps_root_calls"] == 1
    # --root-tool-timeout, --hosted-tool-timeout, --root-tool-max-result-bytes, --no-sub-llm-final-answer-turn,
    # --max-startup-wait-seconds, --no-abort-on-code-timeout: recorded as the run's settings
    settings = json.loads((folder / "meta.json").read_text(encoding="utf-8"))["settings"]
    assert settings["root_tool_timeout"] == 30 and settings["root_tool_max_result_bytes"] == 1500
    assert settings["hosted_tool_timeout"] == 45
    assert settings["sub_llm_final_answer_turn"] is False and settings["max_startup_wait_seconds"] == 200
    assert settings["abort_on_code_timeout"] is False and settings["max_depth"] == 2
    # --child-root-min-grant-tokens: recorded here; its effect (a child ending budget_spent) is
    # tests/e2e/test_tree_budget.py's
    assert settings["child_root_min_grant_tokens"] == 300
    # --root-model-timeout: recorded (that the root client takes it: tests/unit/test_settings_declared_once.py)
    assert settings["root_model_timeout"] == 300
    assert settings["tools"] == ["rlmq.workers.tools:count_words"] and settings["root_tools"] == ["json:dumps"]
    # --concurrency 1: the second rollout's cell started after the first one's ended
    spans = sorted(tuple(float(t) for t in row["final_answer"].split()) for row in rows)
    assert spans[0][1] <= spans[1][0], spans
    # --workers 1: one worker served every sub-call
    workers = {
        x["worker"]
        for t in read_jsonl(folder / "trajectories.jsonl")
        for e in t["trajectory"]
        if e["type"] == "llm_batch"
        for x in e["results"]
    }
    assert len(workers) == 1, workers
    # --no-include-sub-llm-in-trajectory: no sub-LLM conversation kept
    results = [
        x
        for t in read_jsonl(folder / "trajectories.jsonl")
        for e in t["trajectory"]
        if e["type"] == "llm_batch"
        for x in e["results"]
    ]
    assert results and not any("messages" in x or "steps" in x or "turn_tokens" in x for x in results)
    assert "token_ids" not in (folder / "trajectories.jsonl").read_text(encoding="utf-8")
    # without --quiet: the progress bar
    assert "rollouts:" in "".join(run.err)
