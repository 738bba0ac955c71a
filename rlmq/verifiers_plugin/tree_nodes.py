"""The served turns of an rlmq tree as trainable nodes of a verifiers 0.4 ``Trace``.

With ``include_sub_llm_in_trajectory``, every sub-call turn and every child rollout's root turn
carries the ids and logprobs its server returned (:func:`rlmq.expand_trajectory`).
:func:`commit_tree` writes each trainable one into the trace as verifiers' interception commits a
model turn (``verifiers/v1/graph.py``, 0.4.0: ``prepare_turn(...).commit(Response(tokens=TurnTokens(
prompt_ids, completion_ids, completion_logprobs)))``, then a ``ModelCall`` pointing at the committed
node), and links the conversations with semantic edges keyed by request ids, as an ACP harness
advertises them (``Trace.add_semantic_edges``): ``subagent_call`` from the root turn whose REPL cell
made the call to the callee's first turn, ``subagent_return`` from the callee's last turn to the
caller's next root turn.

The node messages are labels (``[rlmq sub b1/0 part 0]``, ``[rlmq child r1/0/root part 0]``) and
the served reply text: rlmq keeps a turn's tokens, not the messages it was rendered from (those are in
``info["rlmq"]``). The tokens are exact: each branch concatenates to the served prompt and
completion, the mask is on the completion only, the logprobs on the sampled positions. A turn that
continues the previous one's prompt and completion extends the same branch; one that does not
(a template that re-renders history) starts a new branch (a new ``part``), so no sampled token is
in two branches. Untrainable turns (no ids, ``frozen_fleet``, ``payload_cap``,
...) and slots that did not answer are left out.

Each committed turn's ``ModelCall.sampling`` (verifiers' "effective sampling settings" of a call)
holds what its request sent, its ``temperature`` and ``top_p`` as sampled (the request's or the
server's default: ``temperature_source``, ``top_p_source``) and, when asked for, its
``weight_versions`` spans over its completion tokens (verifiers 0.4 has no field of its own for them).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1 import graph

__all__ = ["TreeNodes", "commit_tree"]

SUBAGENT_CALL = "subagent_call"
SUBAGENT_RETURN = "subagent_return"


@dataclass
class TreeNodes:
    """What :func:`commit_tree` added: ``turns`` (committed trainable turns), ``edges`` (semantic
    edges), ``conversations`` (sub-calls and child rollouts with at least one turn committed)."""

    turns: int = 0
    edges: int = 0
    conversations: int = 0
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _edges: list[vf.SemanticEdge] = field(default_factory=list)

    def request_id(self) -> str:
        return f"rlmq.{next(self._ids)}"

    def link(self, source: str | None, target: str | None, kind: str) -> None:
        if source is not None and target is not None:
            self._edges.append(vf.SemanticEdge(source_request_id=source, target_request_id=target, type=kind))


def _dicts(items: Any) -> Iterator[dict[str, Any]]:
    if isinstance(items, list):
        yield from (i for i in items if isinstance(i, dict))


Turns = list[tuple[dict[str, Any], str]]
"""One conversation's turns, each with its reply text."""


def _commit_turns(trace: vf.Trace, label: str, turns: Turns, out: TreeNodes) -> list[str | None]:
    """Commit one conversation's turns; one request id per turn, ``None`` for a turn left out
    (untrainable). A turn whose prompt extends the previous turn's prompt and completion goes on
    the same path; any other starts a new part (its own root). Every prompt message is given its
    token span (the label none, each earlier reply the tokens its node holds), so the commit finds
    each reused prefix node by key (only a new label is looked up across the graph, verifiers'
    cost: ``bench.tree_nodes``)."""
    part = 0
    ids: list[str | None] = []
    prompt: list[Any] = []
    seen: list[int] = []
    spans: list[tuple[int, int] | None] = []
    for turn, text in turns:
        if not turn.get("trainable"):
            prompt, seen, spans = [], [], []
            ids.append(None)
            continue
        prompt_ids = list(turn["prompt_token_ids"])
        if not prompt or prompt_ids[: len(seen)] != seen:
            prompt, seen, spans = [vf.UserMessage(content=f"[rlmq {label} part {part}]")], [], [(0, 0)]
            part += 1
        rid = out.request_id()
        reply = vf.AssistantMessage(content=text)
        completion = list(turn["completion_token_ids"])
        tokens = vf.TurnTokens(
            prompt_ids=prompt_ids,
            completion_ids=completion,
            completion_logprobs=list(turn["completion_logprobs"]),
            message_spans=list(spans),
        )
        response = vf.Response(id=rid, created=0, model="", message=reply, finish_reason=None, tokens=tokens)
        node = graph.prepare_turn(trace, list(prompt)).commit(response)
        trace.calls.append(vf.ModelCall(node=node, acp=vf.ACPInfo(request_id=rid), sampling=_call_sampling(turn)))
        spans.append((len(seen), len(prompt_ids) + len(completion)))
        prompt.append(reply)
        seen = prompt_ids + completion
        ids.append(rid)
        out.turns += 1
    return ids


def _call_sampling(turn: dict[str, Any]) -> vf.SamplingConfig:
    """A turn's sampling as its model call keeps it: what was sent, then the temperature and top-p its
    tokens were sampled at (with their sources) and its weight-version spans, when recorded."""
    sent = turn.get("sampling")
    out: dict[str, Any] = dict(sent) if isinstance(sent, dict) else {}
    drawn = turn.get("sampled_with")
    if isinstance(drawn, dict):
        out.update(drawn)
    if isinstance(turn.get("weight_versions"), list):
        out["weight_versions"] = turn["weight_versions"]
    return vf.SamplingConfig.model_validate(out)


def _sub_turns(result: dict[str, Any]) -> Turns:
    steps = list(_dicts(result.get("steps")))
    replies = [str(m.get("content") or "") for m in _dicts(result.get("messages")) if m.get("role") == "assistant"]
    if len(replies) != len(steps):
        replies = [""] * len(steps)
    return list(zip(steps, replies, strict=True))


def _rollout(
    trace: vf.Trace, trajectory: list[dict[str, Any]], root_ids: list[str | None], path: str, out: TreeNodes
) -> None:
    """Commit the sub-calls and children of one rollout whose root turns have ``root_ids``."""
    turn = -1
    for event in trajectory:
        kind = event.get("type")
        if kind == "root":
            turn += 1
        if kind not in ("llm_batch", "rlm_batch"):
            continue
        caller = root_ids[turn] if 0 <= turn < len(root_ids) else None
        after = root_ids[turn + 1] if turn + 1 < len(root_ids) else None
        for i, res in enumerate(_dicts(event.get("results"))):
            if res.get("status") != "ok":
                continue
            where = f"{path}{event.get('batch_id', '?')}/{res.get('index', i)}"
            child = res.get("child")
            if isinstance(child, dict):
                ids = _child(trace, list(_dicts(child.get("trajectory"))), f"{where}/", out)
            else:
                ids = _commit_turns(trace, f"sub {where}", _sub_turns(res), out)
            done = [rid for rid in ids if rid is not None]
            if done:
                out.conversations += 1
                out.link(caller, done[0], SUBAGENT_CALL)
                out.link(done[-1], after, SUBAGENT_RETURN)


def _child(trace: vf.Trace, trajectory: list[dict[str, Any]], path: str, out: TreeNodes) -> list[str | None]:
    roots = [(e, str(e.get("content") or "")) for e in trajectory if e.get("type") == "root"]
    ids = _commit_turns(trace, f"child {path}root", roots, out)
    _rollout(trace, trajectory, ids, path, out)
    return ids


def _top_root_ids(trace: vf.Trace, trajectory: list[dict[str, Any]], out: TreeNodes) -> list[str | None]:
    """Request ids for the top rollout's root turns, which verifiers' interception committed
    itself: its committed calls, in order, one per root event. When the counts differ (a call
    verifiers recorded that rlmq did not use) the top rollout gets no edges."""
    calls = [c for c in trace.calls if c.node is not None and c.error is None]
    roots = [e for e in trajectory if e.get("type") == "root"]
    if len(calls) != len(roots):
        return [None] * len(roots)
    ids: list[str | None] = []
    for call in calls:
        if call.acp is None:
            call.acp = vf.ACPInfo(request_id=out.request_id())
        ids.append(call.acp.request_id)
    return ids


def commit_tree(trace: vf.Trace, trajectory: list[dict[str, Any]]) -> TreeNodes:
    """Write every trainable served turn of the tree below the top rollout into ``trace``.

    Args:
        trace: the rollout's trace, its top root turns already committed by verifiers.
        trajectory: rlmq's trajectory of the top rollout, expanded (token fields as JSON lists).

    Returns:
        What was added. A tree without token fields adds nothing.

    Raises:
        ValueError: verifiers refused an edge (a request id with no committed node).
    """
    out = TreeNodes()
    events = list(_dicts(trajectory))
    root_ids = _top_root_ids(trace, events, out)
    _rollout(trace, events, root_ids, "", out)
    if out._edges:
        trace.add_semantic_edges(vf.SemanticEdgeSet(edges=out._edges))
        out.edges = len(out._edges)
    return out
