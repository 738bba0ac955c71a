"""rlmq's trainable tree branches through prime-rl's own sample builder, ``trace_to_samples``.

prime-rl is not a dependency: ``--prime-rl`` names a prime-rl git directory (a clone or a bare
mirror). At run time this reads, at ``--commit``, ``src/prime_rl/orchestrator/trajectories.py``
and the module that defines ``TrainingSample`` (it needs ``msgspec``) into a temporary folder,
puts light stand-ins for the rest of what the builder imports (the package ``__init__`` files
that re-export ``TrainingSample``, ``prime_rl.utils.logger``), and imports the builder from
there. Nothing of prime-rl is kept. Before running it, the ``branch.*``, ``node.*`` and
``trace.*`` attributes the builder reads are looked up on the installed verifiers; one it reads
that verifiers 0.4.0 does not have, ``Branch.multi_modal_data`` (a branch's images), is given
the value ``None`` (no images: these traces are text) for the run, and the results say so.

Three traces go through it:

* ``synthetic``: the tree of ``tests/unit/test_tree_nodes.py`` (a sub-call whose second turn
  extends its first, one that re-renders, an untrainable turn, a rejected call, a child with a
  sub-call and two root turns on one branch), compared with the restated contract there;
* ``harness``: two ``vf-eval rlmq`` episodes, each run in this process by verifiers' own eval
  runner with ``include_sub_llm_in_trajectory``, on a private embedded Redis, real ``rlmq worker
  --repl-slots`` processes and the scripted model serving vLLM's token fields: ``needle``, the
  needle search of ``bench.needle`` at ``--depth`` (the default 2: the root splits the context
  over child rollouts, each of which makes sub-calls), and ``turns`` (:func:`turns_row`: several
  turns at every level of a depth-2 tree). Each trace is sent through verifiers' env-serve
  msgpack encoding and validated as a ``WireTrace`` (what prime-rl's orchestrator receives),
  then every sample is compared, element by element, with what the scripted model recorded
  serving (``GET /served``).

Run: ``python -m bench.prime_rl_samples --prime-rl /path/to/prime-rl[.git] [--commit SHA]
[--depth 2]``; prints the figures and saves them to a new file,
``bench/results/prime_rl_samples_<UTC time>.json`` (or ``--out``; an existing file is never
overwritten). Without ``--prime-rl``, or without ``msgspec``, it prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.harness import RESULTS_DIR, machine, save_json, say
from rlmq.scripted.server import root_code_directive

DEFAULT_COMMIT = "b453f40d8"
"""prime-rl's "train shared sampled nodes exactly once across branches" (2026-07-08)."""
BUILDER = "src/prime_rl/orchestrator/trajectories.py"
LOGGER = "prime_rl.utils.logger"
NO_IMAGES = "multi_modal_data"
"""The one ``Branch`` attribute the builder reads that verifiers 0.4.0 lacks: ``None`` = no images."""


def git(git_dir: str, *args: str) -> str:
    """``git -C git_dir ARGS``'s stdout; raises ``SystemExit`` with git's message when it fails."""
    done = subprocess.run(["git", "-C", git_dir, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} in {git_dir}: {done.stderr.strip()}")
    return done.stdout


def prime_rl_imports(source: str) -> dict[str, list[str]]:
    """The ``from prime_rl.X import a, b`` statements of ``source``: module -> names."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prime_rl"):
            out.setdefault(str(node.module), []).extend(a.name for a in node.names)
    return out


def _write(root: Path, module: str, text: str, package: bool = False) -> None:
    path = root.joinpath(*module.split("."))
    path = path / "__init__.py" if package else path.with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in [p for p in path.parents if root in p.parents]:
        (parent / "__init__.py").touch()
    path.write_text(text, encoding="utf-8")


def load_builder(git_dir: str, commit: str) -> tuple[ModuleType, str, dict[str, Any]]:
    """Import prime-rl's ``trajectories`` module of ``commit`` from a temporary folder.

    Returns:
        The module, its source, and what was read and stood in for (``commit`` as a full SHA,
        its date and subject).

    Raises:
        SystemExit: the commit, the builder or the module defining ``TrainingSample`` is not in
            the git directory, or the builder imports a prime-rl module this cannot stand in for.
    """
    sha = git(git_dir, "rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    source = git(git_dir, "show", f"{sha}:{BUILDER}")
    found = git(git_dir, "grep", "-l", "^class TrainingSample", sha, "--", "src/prime_rl").split()
    if len(found) != 1:
        raise SystemExit(f"prime-rl {sha[:9]}: TrainingSample defined in {found or 'no file'}")
    types_path = found[0].split(":", 1)[1]
    types_module = types_path.removeprefix("src/").removesuffix(".py").replace("/", ".")
    stubs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="prime-rl-") as tmp:
        root = Path(tmp)
        _write(root, "prime_rl.orchestrator.trajectories", source)
        _write(root, types_module, git(git_dir, "show", f"{sha}:{types_path}"))
        for imported, names in prime_rl_imports(source).items():
            if imported == types_module:
                continue
            if imported == LOGGER:
                _write(
                    root, imported, "import logging\n\n\ndef get_logger():\n    return logging.getLogger('prime_rl')\n"
                )
            elif types_module.startswith(imported + "."):
                _write(root, imported, f"from {types_module} import {', '.join(names)}  # noqa: F401\n", package=True)
            else:
                raise SystemExit(f"prime-rl {sha[:9]}: the builder imports {imported}, which this cannot stand in for")
            stubs.append(imported)
        for name in [m for m in sys.modules if m == "prime_rl" or m.startswith("prime_rl.")]:
            del sys.modules[name]
        sys.path.insert(0, tmp)
        try:
            module = importlib.import_module("prime_rl.orchestrator.trajectories")
        finally:
            sys.path.remove(tmp)
    date, subject = git(git_dir, "show", "-s", "--format=%as%x00%s", sha).strip().split("\x00", 1)
    info = {"commit": sha, "date": date, "subject": subject, "read": [BUILDER, types_path], "stubbed": stubs}
    return module, source, info


def attributes_read(source: str) -> dict[str, set[str]]:
    """The attributes the builder reads on ``branch``, ``node`` and ``trace`` (by variable name)."""
    out: dict[str, set[str]] = {"branch": set(), "node": set(), "trace": set()}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in out:
            out[node.value.id].add(node.attr)
    return out


def api_check(source: str) -> dict[str, Any]:
    """Which attributes the builder reads exist on the installed verifiers' ``Branch``,
    ``MessageNode`` and ``Trace`` (fields, properties and methods)."""
    import verifiers
    import verifiers.v1 as vf
    from verifiers.v1 import graph

    classes = {"branch": vf.Branch, "node": graph.MessageNode, "trace": vf.Trace}
    read = attributes_read(source)
    missing = {
        kind: sorted(a for a in attrs if a not in classes[kind].model_fields and not hasattr(classes[kind], a))
        for kind, attrs in read.items()
    }
    return {
        "verifiers": verifiers.__version__,
        "read": {k: sorted(v) for k, v in read.items()},
        "missing": {k: v for k, v in missing.items() if v},
    }


@contextlib.contextmanager
def no_images(missing: dict[str, list[str]]) -> Iterator[list[str]]:
    """Give ``vf.Branch`` a ``multi_modal_data`` of ``None`` while the builder runs, when verifiers
    has none; yields the stand-ins made. Raises ``SystemExit`` for any other missing attribute."""
    import verifiers.v1 as vf

    others = {k: [a for a in v if not (k == "branch" and a == NO_IMAGES)] for k, v in missing.items()}
    if any(others.values()):
        raise SystemExit(f"the builder reads attributes the installed verifiers lacks: {others}")
    made = [f"Branch.{NO_IMAGES} = None"] if NO_IMAGES in missing.get("branch", []) else []
    if made:
        setattr(vf.Branch, NO_IMAGES, None)
    try:
        yield made
    finally:
        if made:
            delattr(vf.Branch, NO_IMAGES)


def sample_rows(samples: list[Any]) -> list[dict[str, Any]]:
    """prime-rl ``TrainingSample`` structs as dicts of their token, mask and logprob lists."""
    return [{"token_ids": list(s.token_ids), "mask": list(s.mask), "logprobs": list(s.logprobs)} for s in samples]


def check_synthetic(builder: ModuleType) -> dict[str, Any]:
    """The unit test's tree through prime-rl's builder, against the restated contract."""
    from rlmq.verifiers_plugin.tree_nodes import commit_tree
    from tests.unit.test_tree_nodes import samples, top_trace, tree

    trace = top_trace()
    trace.ok = True  # a concluded rollout (builders before b453f40d8 mask an errored trace out)
    commit_tree(trace, tree())
    theirs = sample_rows(builder.trace_to_samples(trace))
    ours = samples(trace)
    return {
        "branches": len(trace.branches),
        "trainable_branches": sum(1 for b in trace.branches if any(b.sampled_mask)),
        "samples": len(theirs),
        "equal_to_restated_contract": theirs == ours,
        "multi_node_samples": sum(1 for s in theirs if _runs(s["mask"]) > 1),
    }


def _runs(mask: list[bool]) -> int:
    """Runs of ``True`` in a mask (sampled spans in one sample)."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def wire(trace: Any) -> Any:
    """``trace`` as prime-rl's orchestrator receives it: verifiers' env-serve msgpack encoding
    (full precision), validated as a ``WireTrace``."""
    import msgpack
    from verifiers.v1.serve.encoding import msgpack_encoder
    from verifiers.v1.trace import WireTrace

    data = msgpack.packb(trace.model_dump(mode="python"), default=msgpack_encoder, use_bin_type=True)
    return WireTrace.model_validate(msgpack.unpackb(data, raw=False))


def harness_episode(fleet: Any, data: Path, out: Path, depth: int, sub_tools: list[str]) -> Any:
    """One ``vf-eval rlmq`` episode of ``data``, by verifiers' eval runner in this process;
    returns its one trace. Raises ``SystemExit`` when the episode did not end ok."""
    from pydantic_config import cli
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.cli.resolve import narrow_config, with_positional_taskset
    from verifiers.v1.configs.cli.eval import EvalConfig

    argv = with_positional_taskset([
        "rlmq", "--env.taskset.path", str(data), "--env.agent.harness.id", "rlmq", "--no-push", "--no-rich",
        "-o", str(out), "--run.name", "run", "--model", fleet.model, "--client.base-url", str(fleet.base_url),
        "--env.agent.harness.include-sub-llm-in-trajectory", "true",
        *(["--env.agent.harness.max-depth", str(depth - 1)] if depth > 1 else []),
    ])  # fmt: skip
    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        config = cli(narrow_config(EvalConfig, argv))
    finally:
        sys.argv = saved
    if sub_tools:  # vf-eval's flags take no list for this knob: set it on the parsed config
        harness = config.env.agent.harness
        config.env.agent.harness = type(harness).model_validate({**harness.model_dump(), "sub_tools": sub_tools})
    before = os.environ.get("REDIS_URL")
    os.environ["REDIS_URL"] = fleet.redis_url
    try:
        (episode,) = asyncio.run(run_eval(config))
    finally:
        os.environ.pop("REDIS_URL")
        if before is not None:
            os.environ["REDIS_URL"] = before
    (trace,) = episode.traces
    if not trace.ok:
        raise SystemExit(f"the episode failed: {trace.errors}")
    return trace


def compare(samples: list[dict[str, Any]], inner: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Each prime-rl sample against the served tree turn it must be, element by element.

    Args:
        samples: prime-rl's samples (``token_ids``, ``mask``, ``logprobs``).
        inner: the served turns of the tree below the top rollout, ``(role, prompt ids,
            completion ids, logprobs)``.

    Returns:
        Counts: samples matched to a served turn, token / mask / logprob elements compared and
        those that differ, prompt positions with a nonzero logprob, served turns never matched.
    """
    by_tokens = {t[1] + t[2]: t for t in inner}
    left = Counter(t[1] + t[2] for t in inner)
    got: Counter[str] = Counter()
    for s in samples:
        turn = by_tokens.get(tuple(s["token_ids"]))
        if turn is None:
            got["samples_with_no_served_turn"] += 1
            continue
        left[turn[1] + turn[2]] -= 1
        got["samples_matched"] += 1
        n_prompt, n_completion = len(turn[1]), len(turn[2])
        want_mask = [False] * n_prompt + [True] * n_completion
        got["token_elements"] += len(s["token_ids"])
        got["mask_elements"] += len(s["mask"])
        got["mask_elements_different"] += sum(a != b for a, b in zip(s["mask"], want_mask, strict=False))
        got["mask_elements_different"] += abs(len(s["mask"]) - len(want_mask))
        got["sampled_logprobs"] += n_completion
        got["sampled_logprobs_different"] += sum(
            a != b for a, b in zip(s["logprobs"][n_prompt:], turn[3], strict=False)
        ) + abs(len(s["logprobs"]) - n_prompt - n_completion)
        got["prompt_logprobs_nonzero"] += sum(1 for lp in s["logprobs"][:n_prompt] if lp != 0.0)
    got["served_turns_unmatched"] = sum(n for n in left.values() if n > 0)
    got["served_turns_matched_twice"] = sum(-n for n in left.values() if n < 0)
    return dict(got)


TOOL = "rlmq.workers.tools.count_words"


def turns_row(path: Path, words: int = 400) -> Path:
    """A one-row dataset whose tree (depth 2) has multi-turn conversations at every level: the top
    rollout's first cell runs two child rollouts, its second cell two sub-calls; each child's
    first cell makes one sub-call, its second ends it; every sub-call whose prompt asks for the
    sub-tool takes two turns (the tool call, then the answer)."""
    body = " ".join(f"w{i % 97}" for i in range(words))
    tool = '[[mock:tool:count_words:{"text": "a b c"}]] '

    def child(k: int) -> str:
        first = f"print(llm_batch([{tool + f'child {k} ' + body!r}]))"
        return (
            f"Child {k}. "
            + root_code_directive(first)
            + root_code_directive("answer.update(content='c', ready=True)", 2)
        )

    first = f"print(rlm_batch({[child(0), child(1)]!r}))"
    second = (
        f"print(llm_batch([{tool + 'top ' + body!r}, {'plain ' + body!r}])); answer.update(content='done', ready=True)"
    )
    row = {"id": "turns", "question": "Run. " + root_code_directive(first) + root_code_directive(second, 2),
           "context": body, "answer": "done"}  # fmt: skip
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return path


def check_harness(builder: ModuleType, depth: int, workers: int, tree: str) -> dict[str, Any]:
    """A real tree through the harness, the msgpack wire and prime-rl's builder, against ``/served``.
    ``tree``: ``needle`` (the needle search of ``bench.needle``, split over child rollouts) or
    ``turns`` (:func:`turns_row`, depth 2 whatever ``depth``)."""
    from rlmq.cli.local import LocalFleet
    from rlmq.common.redis_server import EmbeddedRedis
    from tests.e2e.test_recursion import needle_data, reset_stats
    from tests.e2e.test_trainable_trees import as_turn, served, tree_turns

    server = EmbeddedRedis().start()
    try:
        with tempfile.TemporaryDirectory(prefix="rlmq-prime-rl-") as tmp:
            tmp_path = Path(tmp)
            with LocalFleet(
                redis_url=server.url, model=f"prime-rl-{uuid.uuid4().hex[:6]}", workers=workers,
                worker_concurrency=16, repl_slots=2, log_dir=str(tmp_path / "logs"), worker_args=["--allow-tool", TOOL],
            ) as fleet:  # fmt: skip
                fleet.wait_for_workers(workers)
                if tree == "turns":
                    data, depth, tools = turns_row(tmp_path / "turns.jsonl"), 2, [TOOL]
                else:
                    data, tools = needle_data(tmp_path, rows=1, split=2, lines=1200)[0], []
                reset_stats(str(fleet.base_url))
                t0 = time.perf_counter()
                live = harness_episode(fleet, data, tmp_path / "out", depth, tools)
                seconds = time.perf_counter() - t0
                all_served = served(str(fleet.base_url))
    finally:
        server.stop()
    trace = wire(live)
    events = trace.info["rlmq"]["trajectory"]
    inner: list[Any] = []
    depths: Counter[int] = Counter()
    tree_turns([e for e in events if e["type"] != "root"], inner, depths)
    want = Counter(as_turn(s["role"], s) for s in all_served)
    theirs = sample_rows(builder.trace_to_samples(trace))
    roles = Counter(t[0] for t in inner)
    trainable = [b for b in trace.branches if any(b.sampled_mask)]
    return {
        "tree": tree,
        "depth": depth,
        "episode_seconds": round(seconds, 1),
        "served_turns": want.total(),
        "top_root_turns": sum(1 for e in events if e["type"] == "root"),
        "tree_turns": len(inner),
        "sub_call_turns": roles["sub"],
        "child_root_turns": roles["root"],
        "child_root_turns_by_depth": dict(sorted(depths.items())),
        "tree_turns_not_served": (Counter(inner) - want).total(),
        "trace_ok_and_agent_trainable": bool(trace.ok and trace.agent.trainable),  # prime-rl drops any other
        "branches": len(trace.branches),
        "trainable_branches": len(trainable),
        "trainable_branches_flagged_untrainable": sum(1 for b in trainable if not b.trainable),
        "tree_nodes": trace.info["rlmq"]["tree_nodes"],
        "samples": len(theirs),
        "samples_same_before_the_wire": sample_rows(builder.trace_to_samples(live)) == theirs,
        "prompt_tokens_longest": max((len(t[1]) for t in inner), default=0),
        **compare(theirs, inner),
    }


def report(name: str, part: dict[str, Any]) -> str:
    """One harness tree's figures as two lines."""
    return (
        f"{name} (depth {part['depth']}): {part['served_turns']} turns served, {part['top_root_turns']} of them the "
        f"top rollout's own (no tokens in its trace), {part['tree_turns']} in the tree ({part['sub_call_turns']} "
        f"sub-call, {part['child_root_turns']} child root); {part['trainable_branches']} trainable branches of "
        f"{part['branches']}\n  prime-rl samples {part['samples']}, matched to a served turn "
        f"{part['samples_matched']}; {part['token_elements']} token ids, {part['mask_elements']} mask elements "
        f"({part['mask_elements_different']} differ), {part['sampled_logprobs']} sampled logprobs "
        f"({part['sampled_logprobs_different']} differ), {part['prompt_logprobs_nonzero']} nonzero prompt logprobs; "
        f"served turns without a sample {part['served_turns_unmatched']}, "
        f"with two {part['served_turns_matched_twice']}; "
        f"same samples before the wire: {part['samples_same_before_the_wire']}"
    )


def main() -> None:
    """Parse the flags, load prime-rl's builder, run the traces through it, print and save."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prime-rl", help="a prime-rl git directory (clone or bare mirror)")
    p.add_argument("--commit", default=DEFAULT_COMMIT, help=f"prime-rl commit (default {DEFAULT_COMMIT})")
    p.add_argument("--depth", type=int, default=2, help="levels of the needle tree, root included")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--out",
        help="where the figures go, STEM.json (default: a new file, "
        "bench/results/prime_rl_samples_<UTC time>.json); an existing file is never overwritten",
    )
    args = p.parse_args()
    if not args.prime_rl:
        print("prime-rl's source is not given: pass --prime-rl /path/to/prime-rl (a git clone or bare mirror)")
        raise SystemExit(2)
    try:
        import msgspec  # noqa: F401 - prime-rl's TrainingSample is a msgspec Struct
    except ImportError:
        print("prime-rl's TrainingSample needs msgspec, which is not installed here: pip install msgspec")
        raise SystemExit(2) from None
    args.out = args.out or os.path.join(RESULTS_DIR, time.strftime("prime_rl_samples_%Y%m%dT%H%M%SZ", time.gmtime()))
    if os.path.exists(f"{args.out}.json"):
        print(f"{args.out}.json exists: pass a new --out (figures are never written over a kept file)")
        raise SystemExit(2)
    builder, source, info = load_builder(args.prime_rl, args.commit)
    api = api_check(source)
    say(f"prime-rl {info['commit'][:9]} ({info['date']}): {info['subject']}")
    with no_images(api["missing"]) as made:
        synthetic = check_synthetic(builder)
        harness = {tree: check_harness(builder, args.depth, args.workers, tree) for tree in ("needle", "turns")}
    doc = {
        "bench": "prime_rl_samples", "date": time.strftime("%Y-%m-%d"), "machine": machine(), "args": vars(args),
        "prime_rl": info, "verifiers_api": api, "stand_ins": made, "synthetic": synthetic, "harness": harness,
    }  # fmt: skip
    print(f"prime-rl {info['commit'][:9]} {info['date']} {info['subject']!r}; verifiers {api['verifiers']}")
    print(f"  read {', '.join(info['read'])}; stood in for {', '.join(info['stubbed'])}; {', '.join(made) or '-'}")
    print(
        f"synthetic tree: {synthetic['samples']} samples of {synthetic['trainable_branches']} trainable branches "
        f"({synthetic['multi_node_samples']} with several sampled spans); equal to the restated contract: "
        f"{synthetic['equal_to_restated_contract']}"
    )
    for tree, part in harness.items():
        print(report(tree, part))
    print("saved", save_json(doc, args.out))


if __name__ == "__main__":
    main()
