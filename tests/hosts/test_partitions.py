"""The fleet on several hosts (network namespaces joined by a bridge, a delay proxy in front of Redis
and the model): a worker host, a REPL host and a trainer host cut off mid-job. Every sub-call is
answered once, no budget is overshot, nothing stalls. Partitions last seconds: the workers' heartbeat
TTL is 3 s and the rollouts' key TTL 10 s, so a host's loss is noticed as fast as in production's 10 s / 30 s."""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

import pytest

from tests.fleet.harness import log_text
from tests.hosts.fleet import HostFleet, driver_answer

pytestmark = pytest.mark.e2e


def wait_go(proc: subprocess.Popen[str], word: str = "go") -> None:
    """Wait for the driver's ``go`` line (its job is about to start), or another ``word`` it says."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == word, f"the driver did not say {word}: {line!r} {proc.stderr.read() if proc.stderr else ''}"


def job_args(f: HostFleet, *extra: str) -> list[str]:
    return ["--redis-url", f.redis_url, "--base-url", f.base_url, "--model", f.model, *extra]


def test_a_worker_host_cut_off_mid_job_and_back_loses_nothing(tmp_path: Any) -> None:
    logs = str(tmp_path / "logs")
    room = ["--concurrency", "8"]  # 24 calls at once in all: 72 calls of 3 s take three waves
    with HostFleet(workers={"w1": room, "w2": room, "w3": room}, rtt_ms=5, log_dir=logs) as f:
        proc = f.start_driver("trainer1", "main-job", *job_args(f), "--rollouts", "3", "--calls", "24",
                              "--budget", "12000", "--cap", "400", "--tokens", "200", "--sleep", "3",
                              "--busy", "20")  # fmt: skip
        wait_go(proc)
        # 20 calls at the model (3 s each), at most 8 from each host: w1 has 4 at least
        wait_go(proc, "busy")
        f.net.down("w1")
        time.sleep(6)  # twice the heartbeat TTL: its jobs are taken back and run elsewhere
        f.net.up("w1")
        out = driver_answer(proc, 90)
    print(out)
    text = log_text(logs)
    assert (out["lost"], out["duplicated"], out["overshoot"]) == (0, 0, 0), (out, text[-3000:])
    # w1 had calls at the model when it was cut off: they were answered there, and run again elsewhere
    assert out["rejected"] == 0 and out["wasted"] >= 1, out
    assert "took back" in text
    assert out["seconds"] < 40, out


def test_a_repl_host_cut_off_for_good_mid_tree_loses_no_tree(tmp_path: Any) -> None:
    """The only REPL host runs the trees' child rollouts when it drops off for good; a REPL host
    started then on another host runs them again, and every tree answers."""
    logs = str(tmp_path / "logs")
    with HostFleet(workers={"w1": [], "repl": ["--repl-slots", "4"], "w2": []}, rtt_ms=1, model_latency=1.0,
                   log_dir=logs) as f:  # fmt: skip
        proc = f.start_driver(
            "trainer1", "tree-job", *job_args(f), "--rollouts", "2", "--parts", "2", "--max-depth", "2",
            "--timeout", "120", "--label", "cut",
        )  # fmt: skip
        wait_go(proc)
        f.driver("trainer1", "wait-children", "--redis-url", f.redis_url, "--model", f.model, "--label", "cut",
                 "--n", "2", "--timeout", "40")  # fmt: skip
        f.net.down("repl")
        f.start_worker("w2", ["--repl-slots", "4"])
        out = driver_answer(proc, 120)
    print(out)
    text = log_text(logs)
    assert out["stop_reasons"] == ["answer_ready", "answer_ready"], (out, text[-3000:])
    assert out["correct"] == 2 and out["errors"] == [] and out["depths"] == [2, 2], out
    assert "took back" in text  # the cut host's child rollouts were taken back...
    with open(f"{logs}/w2.log", errors="replace") as log:
        assert "hosted child rollouts" in log.read()  # ...and run again on the new REPL host


def test_a_trainer_host_cut_off_for_good_mid_tree_frees_the_fleet(tmp_path: Any) -> None:
    """trainer2's trees (children on the REPL host) lose their trainer for good while their children
    run (3 s per model call, so they need grants after the tree's 10 s lease): the children end (their
    tree's node lapsed), their jobs drain, no worker holds a call of theirs, no ledger a reservation,
    and ``rlmq status`` drops them; trainer1's trees, beside them on the same workers, all answer."""
    logs = str(tmp_path / "logs")
    ttl = ["--rollout-key-ttl", "10"]
    with HostFleet(workers={"w1": [], "repl": ["--repl-slots", "4"]}, rtt_ms=1,
                   trainers=("trainer1", "trainer2"), model_latency=3.0, log_dir=logs) as f:  # fmt: skip
        doomed = f.start_driver("trainer2", "tree-job", *job_args(f), "--rollouts", "2", "--parts", "2",
                                "--max-depth", "3", "--label", "doomed", *ttl)  # fmt: skip
        wait_go(doomed)
        other = f.start_driver("trainer1", "tree-job", *job_args(f), "--rollouts", "2", "--parts", "2",
                               "--max-depth", "2", "--label", "other", "--timeout", "120", *ttl)  # fmt: skip
        wait_go(other)
        f.driver("trainer1", "wait-children", "--redis-url", f.redis_url, "--model", f.model, "--label", "doomed",
                 "--n", "2", "--timeout", "40")  # fmt: skip
        f.net.down("trainer2")  # while its children run on the REPL host
        cut = time.monotonic()
        out = driver_answer(other, 120)
        drained = f.driver("trainer1", "drained", "--redis-url", f.redis_url, "--model", f.model, "--timeout", "40")
        freed = time.monotonic() - cut
        doomed.kill()
        doomed.communicate()
    print(out, drained, freed)
    text = log_text(logs)
    assert out["stop_reasons"] == ["answer_ready", "answer_ready"] and out["correct"] == 2, (out, text[-3000:])
    # nothing of trainer2's left running or listed in rlmq status
    assert drained["seconds"] is not None, (drained, text[-3000:])
    assert drained["open_reservations"] == 0, drained  # no ledger holds a reservation of the lost trees
    assert freed < 60, freed
    # trainer2's children outlived their tree's lease on the REPL host: they ended without an answer
    with open(f"{logs}/repl.log", errors="replace") as log:
        hosted = re.search(r"hosted child rollouts: (\d+) finished \(answer_ready=(\d+)", log.read())
    assert hosted is not None and int(hosted[2]) < int(hosted[1]), hosted
