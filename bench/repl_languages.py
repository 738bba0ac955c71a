"""What a cell and an ``llm_batch`` cost in the Python REPL and in the bash REPL (same sandbox).

Starts one REPL of each language on this host (namespaces, own uid, cgroup where the host allows),
with an interception server that answers every prompt at once, and times: REPL start (with a
1 MB ``context.txt``), a trivial cell, and a cell making one ``llm_batch`` of 10 prompts (in bash a
command, so a helper interpreter starts per call). Prints a table and saves
``bench/results/repl_languages.json``.

    python -m bench.repl_languages [--cells 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rlmq.common.schemas import DatasetRow
from rlmq.producer.interception import InterceptionServer
from rlmq.producer.repl import Repl
from rlmq.producer.repl.files import context_files, repl_context

CELLS = {
    "python": ("x = 1", "r = llm_batch([f'p{i}' for i in range(10)])"),
    "bash": ("x=1", "r=$(llm_batch p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 2>/dev/null)"),
}


async def one(language: str, cells: int, server: InterceptionServer) -> dict[str, Any]:
    async def answer(prompts: list[str]) -> tuple[list[str], str]:
        return [p.upper() for p in prompts], ""

    token = server.register(answer)
    row = DatasetRow(id="b", question="q", context="word " * 200_000)
    repl = Repl(
        context=repl_context(row), files=context_files(row), endpoint_url=server.url,
        unix_socket=server.unix_path_of(token), token=token, language=language,
    )  # fmt: skip
    t0 = time.perf_counter()
    await repl.start()
    started = time.perf_counter() - t0
    out: dict[str, Any] = {"start_seconds": round(started, 4)}
    try:
        for name, code in zip(("trivial_cell", "llm_batch_cell"), CELLS[language], strict=True):
            times = []
            for _ in range(cells):
                t = time.perf_counter()
                res = await repl.execute(code)
                times.append(time.perf_counter() - t)
                assert not res.restarted, res.output
            out[f"{name}_ms_median"] = round(1000 * statistics.median(times), 2)
            out[f"{name}_ms_p90"] = round(1000 * sorted(times)[int(0.9 * len(times)) - 1], 2)
    finally:
        await repl.close()
        server.unregister(token)
    return out


async def main(cells: int) -> dict[str, Any]:
    server = InterceptionServer()
    await server.start()
    try:
        return {lang: await one(lang, cells, server) for lang in ("python", "bash")}
    finally:
        await server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=30)
    args = parser.parse_args()
    figures = asyncio.run(main(args.cells))
    figures["cells"] = args.cells
    figures["date"] = time.strftime("%Y-%m-%d")
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # a shared machine: figures scale with it
    figures["cpus"] = os.cpu_count()
    for lang in ("python", "bash"):
        print(lang, json.dumps(figures[lang]))
    Path(__file__).with_name("results").joinpath("repl_languages.json").write_text(json.dumps(figures, indent=2) + "\n")
