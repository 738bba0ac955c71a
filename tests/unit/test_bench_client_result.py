"""The queue-path benchmark reads a measured client's figures whole, whatever their size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.queue_path import client_result

CLIENT = """
import json, os, sys
out = {"latencies": [0.001 * i for i in range(200_000)], "wall": 1.5, "errors": 0}
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as fh:
    json.dump(out, fh)
os.replace(tmp, sys.argv[1])
print("some other line", flush=True)
print("RESULT", flush=True)
"""


def test_a_result_of_megabytes_is_read_whole(tmp_path: Path) -> None:
    """A real client process with 200,000 latencies (about 2 MB of JSON, far past the 131 KB
    at which a RESULT line on stdout was once cut)."""
    path = tmp_path / "result.json"
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = client_result(proc.stdout, str(path))
    assert proc.wait(60) == 0
    assert out is not None and len(out["latencies"]) == 200_000 and out["wall"] == 1.5
    assert path.stat().st_size > 1_000_000


def test_no_result_line_is_none(tmp_path: Path) -> None:
    assert client_result(iter(["READY\n", "crashed\n"]), str(tmp_path / "missing.json")) is None
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    try:
        client_result(iter(["RESULT\n"]), str(tmp_path / "list.json"))
    except ValueError as exc:
        assert "not a JSON object" in str(exc)
    else:
        raise AssertionError("a result that is not an object must be refused")
