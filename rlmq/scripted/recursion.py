"""The scripted model's recursive needle search: a root that splits ``context`` and recurses.

One server plays every part of a rollout tree, from the prompt alone:

* a **root** (a request offering ``call_python_repl``) whose first user message has
  ``[[mock:rlm-split:<K>]]`` answers turn 1 with :func:`split_root_code`: split ``context`` into
  ``K`` parts, then ``rlm_batch`` one child task per part (the same question, that part as its
  ``context``) when the system message says ``rlm_batch`` recurses at this depth
  (:func:`recursion_of`), else ``llm_batch`` one leaf prompt per part; then combine the answers;
* an **rlm-format root** (no tools, a system message that asks for ```` ```repl ```` blocks, as the
  RLM paper's ``rlms`` package sends) answers turn 1 with :func:`rlm_format_reply`: the same
  search written for that package's REPL (``rlm_query_batched``, which runs plain completions by
  itself at its ``max_depth``), the question read from the first line of ``context`` that holds
  ``[[mock:rlm-split:K]]``; later turns get a block that only sets ``answer["ready"]``;
* a **leaf** sub-LLM (no ``call_python_repl`` tool) whose prompt has ``[[mock:needle]]`` or
  ``[[mock:rlm-split:<K>]]`` answers :func:`needle_answer`: the code of the first line
  ``the secret code is <X>`` of its prompt, or ``none``.

The scaffold contract (what the system message of every root must say, one line, anywhere in it):
``rlm_batch: recursive (depth D of M)`` when ``D < M`` (``rlm_batch`` starts child rollouts), or
``rlm_batch: plain sub-LLM calls (depth D of M)`` when ``D == M``. Matching is case-insensitive
and tolerant of spacing. Without either line, a system message that mentions ``rlm_batch`` and
says ``depth D of M`` or ``level (D of M)`` somewhere recurses when ``D < M``; anything else
(today's depth-1 scaffold) means "does not recurse".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SPLIT_RE = re.compile(r"\[\[mock:rlm-split:(\d+(?:,\d+)*)\]\]")
NEEDLE_MARK = "[[mock:needle]]"
NO_NEEDLE = "none"
MAX_PARTS = 1000
"""The largest ``K`` of ``[[mock:rlm-split:K]]`` (a larger one is taken as this)."""

_RECURSIVE_RE = re.compile(r"rlm_batch\s*:\s*recursive\s*\(\s*depth\s+(\d+)\s+of\s+(\d+)\s*\)", re.IGNORECASE)
_PLAIN_RE = re.compile(
    r"rlm_batch\s*:\s*plain\s+sub-LLM\s+calls(?:\s*\(\s*depth\s+(\d+)\s+of\s+(\d+)\s*\))?", re.IGNORECASE
)
_DEPTH_PROSE_RE = re.compile(r"\b(?:depth|level)\s*\(?\s*(\d+)\s+of\s+(\d+)\b", re.IGNORECASE)
_NEEDLE_RE = re.compile(r"\bthe\s+secret\s+code\s+is\s+([^\s.,;:!?\"'<>]+)", re.IGNORECASE)
_DIRECTIVE_RE = re.compile(r"\[\[mock:.*?\]\]", re.DOTALL)


def scaffold_line(depth: int, max_depth: int) -> str:
    """The line the root scaffold is expected to carry at ``depth`` of ``max_depth`` (both >= 1).

    ``rlm_batch: recursive (depth 1 of 3)`` or ``rlm_batch: plain sub-LLM calls (depth 3 of 3)``.
    """
    if depth < max_depth:
        return f"rlm_batch: recursive (depth {depth} of {max_depth})"
    return f"rlm_batch: plain sub-LLM calls (depth {depth} of {max_depth})"


@dataclass(frozen=True, slots=True)
class Recursion:
    """What a root's system message says about ``rlm_batch``.

    Attributes:
        recurses: True when the ``recursive`` line is present.
        depth: ``D`` of the line, or ``None`` when no line says it.
        max_depth: ``M`` of the line, or ``None``.
    """

    recurses: bool
    depth: int | None = None
    max_depth: int | None = None


def recursion_of(system: str) -> Recursion:
    """Parse the scaffold line (see the module docstring) out of a root's system message."""
    match = _RECURSIVE_RE.search(system)
    if match is not None:
        return Recursion(True, int(match.group(1)), int(match.group(2)))
    match = _PLAIN_RE.search(system)
    if match is not None:
        if match.group(1) is not None:
            return Recursion(False, int(match.group(1)), int(match.group(2)))
        return Recursion(False)
    if "rlm_batch" in system:  # the fallback: "depth D of M" / "level (D of M)" in prose about rlm_batch
        match = _DEPTH_PROSE_RE.search(system)
        if match is not None:
            depth, max_depth = int(match.group(1)), int(match.group(2))
            return Recursion(depth < max_depth, depth, max_depth)
    return Recursion(False)


def split_parts(first_user: str, depth: int | None = None) -> int | None:
    """``K`` of the ``[[mock:rlm-split:K]]`` directive in ``first_user`` (1..:data:`MAX_PARTS`), or ``None``.

    ``[[mock:rlm-split:K1,K2,K3]]`` gives one ``K`` per depth: ``K1`` for a root at depth 1 (or an
    unknown ``depth``), ``K2`` at depth 2, and the last one for every depth beyond the list.
    """
    match = SPLIT_RE.search(first_user)
    if match is None:
        return None
    per_depth = [int(k) for k in match.group(1).split(",")]
    k = per_depth[min(max(depth or 1, 1), len(per_depth)) - 1]
    return max(1, min(MAX_PARTS, k))


def needle_answer(prompt: str) -> str:
    """The leaf rule: ``X`` of the first ``the secret code is X`` in ``prompt`` (directives removed),
    else :data:`NO_NEEDLE` (``"none"``). ``X`` ends at whitespace or punctuation other than ``-``/``_``.

    >>> needle_answer("Find it.\\nline 7: the secret code is amber-4821.\\n")
    'amber-4821'
    """
    if "[[mock:" in prompt:
        prompt = _DIRECTIVE_RE.sub(" ", prompt)
    match = _NEEDLE_RE.search(prompt)
    return match.group(1) if match else NO_NEEDLE


def is_needle_prompt(prompt: str) -> bool:
    """True when a sub-LLM prompt asks for the needle rule (``[[mock:needle]]`` or ``[[mock:rlm-split:K]]``)."""
    return NEEDLE_MARK in prompt or SPLIT_RE.search(prompt) is not None


LEAF_INSTRUCTION = (
    "Find the line 'the secret code is ...' in the text below and reply with the code only, "
    f"or {NO_NEEDLE} if the text has no such line. {NEEDLE_MARK}"
)

_SPLIT_CODE = '''\
# Scripted root model (rlmq test double): recursive needle search over `context`.
from collections import Counter

question = __QUESTION__
PARTS = __PARTS__
RECURSE = __RECURSE__  # the system message says rlm_batch starts child rollouts at this depth
LEAF = __LEAF__


def split(value, k):
    """k contiguous parts of a str (by lines) or of a list/tuple (by items); never more parts than lines/items."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = str(value).splitlines()
    k = max(1, min(k, len(items)))
    bounds = [len(items) * i // k for i in range(k + 1)]
    parts = [items[bounds[i]:bounds[i + 1]] for i in range(k)]
    if isinstance(value, (list, tuple)):
        return parts
    return ["\\n".join(part) for part in parts]


def as_text(part):
    return "\\n".join(str(item) for item in part) if isinstance(part, list) else str(part)


parts = split(context, PARTS)
fan_out = None
if RECURSE:
    try:
        fan_out = rlm_batch
    except NameError:  # no rlm_batch in this REPL: the leaf path
        fan_out = None
if fan_out is not None:
    via = "rlm_batch"
    replies = fan_out([{"prompt": question, "context": part} for part in parts])
else:
    via = "llm_batch"
    replies = llm_batch(
        [f"{LEAF}\\n\\n<question>\\n{question}\\n</question>\\n\\n<text>\\n{as_text(part)}\\n</text>" for part in parts]
    )

found = []
for reply in replies:
    reply = str(reply).strip()
    if not reply or reply.startswith(("[error]", "[rejected]")):
        continue
    word = reply.split()[0].strip(".,;:!?\\"'")
    if word.lower() in ("", "none", "not", "tok"):
        continue
    found.append(word)
votes = Counter(found)
best = votes.most_common(1)[0][0] if votes else "none"
print(f"{len(parts)} part(s) via {via}, {len(found)} with a code: {dict(votes)}")
answer["content"] = best
answer["ready"] = True
'''


def split_root_code(question: str, parts: int, *, recurse: bool) -> str:
    """The Python code of a recursive-needle root's first turn.

    It expects the REPL globals ``context`` (a str, split by lines, or a list/tuple, split by
    items; anything else is ``str()``-ed), ``llm_batch``, ``answer`` and, when ``recurse``,
    ``rlm_batch`` (missing: it falls back to ``llm_batch``). It cuts ``context`` into
    ``min(parts, lines or items)`` contiguous parts of near-equal size; with ``recurse`` it calls
    ``rlm_batch([{"prompt": question, "context": part}, ...])``, else ``llm_batch`` with one
    leaf prompt per part (:data:`LEAF_INSTRUCTION`, then ``question`` and the part's text in
    ``<question>``/``<text>`` tags). Of the replies it keeps the first word of each that is not
    empty, ``[error]...``/``[rejected]...``, ``none``, ``NOT FOUND`` or ``tok`` (a spend-all
    reply); the most common one (or ``none``) becomes ``answer["content"]``, and
    ``answer["ready"] = True``. ``question`` is copied verbatim, directives included, so they
    reach every child and every leaf.
    """
    return (
        _SPLIT_CODE.replace("__QUESTION__", repr(question), 1)
        .replace("__PARTS__", str(int(parts)), 1)
        .replace("__RECURSE__", "True" if recurse else "False", 1)
        .replace("__LEAF__", repr(LEAF_INSTRUCTION), 1)
    )


RLM_FORMAT_MARK = "```repl"
"""A system message holding this (and no tools offered) is an rlm-format root request."""

_RLM_FORMAT_CODE = """\
# Scripted root model (rlmq test double) in the rlms package's REPL: recursive needle search.
# context: the question line (with [[mock:rlm-split:K]]) and the haystack lines.
lines = str(context).splitlines()
question = next((line for line in lines if "[[mock:rlm-split:" in line), "")
parts_wanted = int(question.split("[[mock:rlm-split:", 1)[1].split("]]", 1)[0]) if question else 1
hay = [line for line in lines if line != question]
k = max(1, min(parts_wanted, len(hay)))
bounds = [len(hay) * i // k for i in range(k + 1)]
prompts = [question + "\\n" + "\\n".join(hay[bounds[i]:bounds[i + 1]]) for i in range(k)]
replies = rlm_query_batched(prompts)
votes = {}
for reply in replies:
    words = str(reply).strip().split()
    word = words[0].strip(".,;:!?\\"'") if words else ""
    if word.lower() in ("", "none", "not", "tok", "error") or word.startswith("["):
        continue
    votes[word] = votes.get(word, 0) + 1
best = max(votes, key=lambda w: votes[w]) if votes else "none"
print(f"{k} part(s) via rlm_query_batched, codes: {votes}")
answer["content"] = best
answer["ready"] = True
"""


def is_rlm_format_root(system: str, offers_tools: bool) -> bool:
    """True for a request of the ``rlms`` package's root: no tools and :data:`RLM_FORMAT_MARK` in its system message."""
    return not offers_tools and RLM_FORMAT_MARK in system


def rlm_format_reply(turn: int) -> str:
    """The rlm-format root's reply at ``turn`` (1-based): turn 1 a ```` ```repl ```` block with the search
    (``rlm_query_batched`` over ``K`` parts of the haystack lines of ``context``, each prompt the
    question line then that part's lines; the most common first word of the replies that is not
    ``none``/``Error``/``[...]`` becomes ``answer["content"]``), later turns a block setting
    ``answer["ready"] = True``."""
    code = _RLM_FORMAT_CODE if turn == 1 else 'answer["ready"] = True\n'
    return f"{RLM_FORMAT_MARK}\n{code}```"
