"""``rlmq run`` refuses an empty --model or a --base-url that is not http(s) before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmq.cli.main import main


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--base-url", "http://127.0.0.1:9/v1", "--model", ""], "--model is empty"),
        (["--base-url", "http://127.0.0.1:9/v1", "--model", "  "], "--model is empty"),
        (["--base-url", "foo", "--model", "m"], "--base-url foo: not an http"),
        (["--base-url", "http://127.0.0.1:9/v1", "--sub-base-url", "127.0.0.1:9", "--model", "m"], "--sub-base-url"),
    ],
)
def test_bad_model_or_url_is_exit_2_and_one_line(
    flags: list[str], expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"id": "a", "question": "?", "context": "c"}) + "\n")
    run_dir = tmp_path / "run"
    assert main(["run", str(ds), *flags, "--run-dir", str(run_dir), "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("rlmq: ") and expect in err[0], err
    assert not run_dir.exists()  # nothing started


def test_mock_llm_on_a_taken_port_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["mock-llm", "--port", str(port)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"rlmq: cannot listen on 127.0.0.1:{port}"), err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--workers", "0"], "--workers"),  # ran a demo with no worker: every sub-call failed, exit 6
        (["run", "ds.jsonl", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--workers", "-3"], "--workers"),
        (["demo", "--metrics-port", "99999"], "--metrics-port"),  # was an internal error, exit 4
        (["worker", "--model", "m", "--metrics-port", "-1"], "--metrics-port"),
        (["mock-llm", "--port", "70000"], "--port"),
        (["worker", "--model", "m", "--grace", "-1"], "--grace"),
        (["worker", "--model", "m", "--redis-wait", "nan"], "--redis-wait"),
        (["mock-llm", "--latency", "-2"], "--latency"),
        (["status", "--watch", "0"], "--watch"),
        (["demo", "--min-chars", "-5"], "--min-chars"),
    ],
)
def test_a_bad_number_of_a_command_flag_is_one_line_exit_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"argument {flag}" in err[0], err
