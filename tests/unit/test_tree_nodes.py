"""The served turns of a tree as trainable ``Trace`` nodes, against the installed verifiers.

Guards what :mod:`rlmq.verifiers_plugin.tree_nodes` relies on in verifiers 0.4: ``graph.prepare_turn``
/ ``PendingTurn.commit`` with ``TurnTokens`` put a turn's prompt ids (unmasked) and completion ids
(masked, with logprobs) on its path; ``Trace.add_semantic_edges`` resolves request ids through
``ModelCall.acp``; ``Trace.branches`` gives one branch per leaf with ``token_ids`` /
``sampled_mask`` / ``logprobs``. :func:`samples` restates prime-rl's sample builder
(``trace_to_samples``: one sample per branch with a sampled token, a sampled node shared by
several branches trained only in the first); ``python -m bench.prime_rl_samples --prime-rl DIR``
runs prime-rl's own builder, read from a prime-rl git directory, on the same tree and on real trees.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.trace import WireTrace

from rlmq.verifiers_plugin.tree_nodes import commit_tree


def samples(trace: vf.Trace) -> list[dict[str, Any]]:
    """prime-rl's contract for a trace's training samples (token ids, mask, logprobs)."""
    index = {id(n): i for i, n in enumerate(trace.nodes)}
    trained: set[int] = set()
    out = []
    for branch in trace.branches:
        mask: list[bool] = []
        for node in branch.nodes:
            own = node.sampled and any(node.mask) and index[id(node)] not in trained
            mask += node.mask if own or not any(node.mask) else [False] * len(node.mask)
            if own:
                trained.add(index[id(node)])
        if any(mask):
            out.append({"token_ids": branch.token_ids, "mask": mask, "logprobs": branch.logprobs})
    return out


def turn(prompt: list[int], completion: list[int], trainable: bool = True) -> dict[str, Any]:
    if not trainable:
        return {"turn": 0, "trainable": False, "untrainable_reason": "no_token_ids", "sampling": {}}
    return {
        "prompt_token_ids": prompt, "completion_token_ids": completion, "trainable": True,
        "completion_logprobs": [-0.5 - t / 1000 for t in completion], "sampling": {},
    }  # fmt: skip


def tree() -> list[dict[str, Any]]:
    p = list(range(100, 140))
    child = [
        {"type": "root", "content": "c1", **turn([7, 8, 9], [20, 21])},
        {"type": "llm_batch", "batch_id": "b1", "results": [{"status": "ok", "index": 0, "steps": [turn(p, [1])]}]},
        {"type": "root", "content": "c2", **turn([7, 8, 9, 20, 21, 5], [22])},  # continues: one branch
    ]
    return [
        {"type": "root", "content": "top1"},
        {"type": "llm_batch", "batch_id": "b1", "results": [
            {"status": "ok", "index": 0, "steps": [turn(p, [1, 2]), turn([*p, 1, 2, 3], [4])]},  # one branch
            {"status": "ok", "index": 1, "steps": [turn(p, [6]), turn([*p, 9], [5])]},  # re-rendered: two
            {"status": "ok", "index": 2, "steps": [turn([], [], trainable=False)]},  # no tokens: left out
            {"status": "rejected", "index": 3},
        ]},
        {"type": "rlm_batch", "batch_id": "r1", "results": [
            {"status": "ok", "index": 0, "child": {"trajectory": child}},
        ]},
        {"type": "root", "content": "top2"},
    ]  # fmt: skip


def top_trace() -> vf.Trace:
    """A trace whose two top root turns verifiers' interception committed (an openai client: no tokens)."""
    trace: vf.Trace = WireTrace.model_validate({"task": {"type": "T", "data": {}}, "agent": {"config": {}}})
    prompt: list[Any] = [vf.UserMessage(content="question")]
    for text in ("top1", "top2"):
        reply = vf.AssistantMessage(content=text)
        resp = vf.Response(id=text, created=0, model="m", message=reply, finish_reason="stop")
        trace.calls.append(vf.ModelCall(node=graph.prepare_turn(trace, prompt).commit(resp)))
        prompt += [reply, vf.UserMessage(content="cell output")]
    return trace


def test_every_trainable_turn_is_a_node_and_each_conversation_a_branch_prime_rl_reads() -> None:
    trace = top_trace()
    added = commit_tree(trace, tree())
    assert (added.turns, added.conversations) == (7, 4)
    got = samples(trace)
    assert len(trace.branches) == 1 + 5 and len(got) == 5  # the top's own branch has no tokens
    p = list(range(100, 140))
    want = {  # each sample: prompt then completion, exactly as served; completion positions masked
        (*p, 1, 2, 3, 4): {40, 41, 43},
        (*p, 6): {40},
        (*p, 9, 5): {41},
        (7, 8, 9, 20, 21, 5, 22): {3, 4, 6},
        (*p, 1): {40},
    }
    assert {tuple(s["token_ids"]): {i for i, m in enumerate(s["mask"]) if m} for s in got} == want
    for s in got:
        assert len(s["logprobs"]) == len(s["token_ids"])
        for i, t in enumerate(s["token_ids"]):
            assert s["logprobs"][i] == ((-0.5 - t / 1000) if s["mask"][i] else 0.0)


def test_the_semantic_edges_tie_each_call_to_its_caller_and_back() -> None:
    trace = top_trace()
    added = commit_tree(trace, tree())
    by_id = {c.acp.request_id: c.node for c in trace.calls if c.acp is not None}
    node_of = {n: rid for rid, n in by_id.items()}
    links = sorted(
        (node_of[link.node], link.type, node_of[target])
        for target, node in enumerate(trace.nodes)
        for link in node.semantic_parents
    )
    top1, top2 = (node_of[c.node] for c in trace.calls[:2])
    calls = [s for s, kind, _ in links if kind == "subagent_call"]
    returns = [t for _, kind, t in links if kind == "subagent_return"]
    assert calls.count(top1) == 3 and len(calls) == 4  # two sub-calls and a child; the child's sub-call
    assert returns.count(top2) == 3 and len(returns) == 4  # the child's sub-call returns to its next root turn
    assert added.edges == len(links) == 8


def test_a_tree_without_token_fields_adds_nothing() -> None:
    trace = top_trace()
    bare = [{k: v for k, v in e.items() if k != "results"} for e in tree()]
    added = commit_tree(trace, bare)
    assert (added.turns, added.edges, len(trace.nodes)) == (0, 0, 4)


def test_the_verifiers_internals_relied_on_are_those_of_the_installed_version() -> None:
    import verifiers

    assert verifiers.__version__.startswith("0.4."), verifiers.__version__
    assert {"message_spans", "prompt_ids", "completion_ids", "completion_logprobs"} <= set(vf.TurnTokens.model_fields)
    assert "acp" in vf.ModelCall.model_fields and "semantic_parents" in graph.MessageNode.model_fields
    assert callable(graph.prepare_turn) and callable(vf.Trace.add_semantic_edges)
    assert {"token_ids", "sampled_mask", "logprobs"} <= {n for n in dir(vf.Branch) if not n.startswith("_")}


def test_a_turn_verifiers_refuses_costs_the_tree_nodes_not_the_rollout() -> None:
    from rlmq.verifiers_plugin.harness import _tree_nodes

    bad = tree()
    bad[1]["results"][0]["steps"][0]["completion_logprobs"] = ["not a number"]
    got = _tree_nodes(top_trace(), [{k: v for k, v in e.items() if k != "results"} for e in tree()])
    assert got == {"turns": 0, "edges": 0, "conversations": 0}
    assert _tree_nodes(top_trace(), bad)["error"].startswith("ValidationError")


def test_each_committed_call_keeps_the_sampling_its_tokens_were_drawn_at_and_their_weight_versions() -> None:
    step = {
        **turn(list(range(100, 110)), [1, 2, 3]), "sampling": {"max_tokens": 64},
        "sampled_with": {
            "temperature": 1.0, "temperature_source": "server_default", "top_p": 0.9, "top_p_source": "request"
        },
        "weight_versions": [{"version": "step-7", "start": 0, "end": 2}, {"version": "step-8", "start": 2, "end": 3}],
    }  # fmt: skip
    trajectory = [{"type": "llm_batch", "batch_id": "b1", "results": [{"status": "ok", "index": 0, "steps": [step]}]}]
    trace = top_trace()
    assert commit_tree(trace, trajectory).turns == 1
    sampling = trace.calls[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (1.0, 0.9, 64)
    dumped = sampling.model_dump()
    assert dumped["temperature_source"] == "server_default" and dumped["weight_versions"] == step["weight_versions"]
    assert WireTrace.model_validate(trace.model_dump()).calls[-1].sampling.model_dump()["weight_versions"]
