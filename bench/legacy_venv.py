"""How long the verifiers 0.1.14 venv of the ``rlmq.verifiers_legacy`` tests takes to build.

Builds it with the commands ``tests/legacy/conftest.py`` builds it with
(:func:`tests.legacy.conftest.build_steps`), in a temporary folder, prints the seconds of each
step and the machine's load, and saves them to ``bench/results/legacy_venv.json``. The pip cache
is whatever this machine has (say which in the saved note)::

    .venv/bin/python -m bench.legacy_venv --note "warm pip cache"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.legacy.conftest import build_steps

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "legacy_venv.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--note", default="", help="what to say about the run (pip cache, machine)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlmq-legacy-venv-") as tmp:
        venv = Path(tmp) / "venv"
        steps = build_steps(venv)
        seconds: dict[str, float] = {}
        for name, argv in steps.items():
            t0 = time.monotonic()
            subprocess.run(argv, check=True, capture_output=True, cwd=ROOT)
            seconds[name] = round(time.monotonic() - t0, 1)
            print(f"{name}: {seconds[name]} s")
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "total_seconds": round(sum(seconds.values()), 1),
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "note": args.note,
    }
    print(json.dumps(result))
    runs = json.loads(OUT.read_text()) if OUT.exists() else []
    OUT.write_text(json.dumps([*runs, result], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
