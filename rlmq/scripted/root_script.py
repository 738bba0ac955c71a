"""The scripted root model's first-turn code: one sub-LLM per chunk of ``context``, majority answer."""

from __future__ import annotations

import shlex

_ROOT_CODE_TEMPLATE = '''\
# Scripted root model (rlmq test double): ask one sub-LLM per chunk of `context`,
# then keep the answer that most chunks agree on.
import json
import math
from collections import Counter

question = __QUESTION__
CHUNK_CHARS = 20_000  # characters per chunk
OVERLAP = 500  # characters shared by neighbouring chunks, so no sentence is lost at a cut


def split_text(text):
    """Windows of CHUNK_CHARS characters; neighbours overlap by OVERLAP characters."""
    step = CHUNK_CHARS - OVERLAP
    return [text[start:start + CHUNK_CHARS] for start in range(0, max(len(text) - OVERLAP, 1), step)]


def group_items(items):
    """Join the items of a list, each str()-ed, into chunks of similar size."""
    pieces = [piece for item in items for piece in split_text(str(item))]
    total = sum(len(piece) + 1 for piece in pieces)
    target = total / max(1, math.ceil(total / CHUNK_CHARS))
    chunks, current, size = [], [], 0
    for piece in pieces:
        if current and size + len(piece) > CHUNK_CHARS:
            chunks.append("\\n".join(current))
            current, size = [], 0
        current.append(piece)
        size += len(piece) + 1
        if size >= target:
            chunks.append("\\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\\n".join(current))
    return chunks


if isinstance(context, dict):
    chunks = split_text(json.dumps(context, ensure_ascii=False, indent=1))
elif isinstance(context, (list, tuple)):
    chunks = group_items(context)
else:
    chunks = split_text(str(context))

prompts = [
    "Answer the question using only the text below. "
    "If the text does not contain the answer, reply exactly NOT FOUND.\\n\\n"
    f"<question>\\n{question}\\n</question>\\n\\n<text>\\n{chunk}\\n</text>"
    for chunk in chunks
]
answers = llm_batch(prompts) if prompts else []


def is_answer(reply):
    """False for NOT FOUND and for rlmq's error strings."""
    reply = reply.strip()
    if reply.startswith(("[error]", "[rejected]")):
        return False
    return bool(reply) and reply.rstrip(".") != "NOT FOUND"


found = [reply.strip() for reply in answers if is_answer(reply)]
votes = Counter(found)  # most_common keeps first-seen order among ties
best = votes.most_common(1)[0][0] if votes else "NOT FOUND"
print(f"{len(chunks)} chunk(s), {len(found)} with an answer: {dict(votes)}")
print(f"answer: {best!r}")
answer["content"] = best
answer["ready"] = True
'''


def root_tool_code(name: str, question: str) -> str:
    """The first-turn code that calls the REPL tool ``name`` with ``question`` and answers with what
    it returns (``str()`` of it), or with ``[tool failed] <message>`` when it raises."""
    return (
        f"try:\n    result = {name}({question!r})\nexcept Exception as exc:\n"
        "    result = f'[tool failed] {exc}'\nprint(repr(result)[:200])\n"
        "answer['content'] = str(result)\nanswer['ready'] = True\n"
    )


def bash_root_code_for(question: str) -> str:
    """The bash code of the root model's first turn for ``question`` (the bash REPL): the context
    files (``context.txt`` / ``context.json``, else every file under the working directory) cut
    in windows of 20,000 characters overlapping by 500, one ``llm_batch`` prompt per window with
    the question (a JSON list on its stdin); the first answer that is not ``NOT FOUND`` (else
    ``NOT FOUND``) becomes ``ANSWER_CONTENT``, and ``ANSWER_READY=1``."""
    return (
        (
            f"question={shlex.quote(question)}\n"
            "if ls context.* >/dev/null 2>&1; then files=$(ls context.*);\n"
            "else files=$(find . -type f ! -name '.*'); fi\n"
            'python3 -c $BASH_ROOT_WINDOWS "$question" $files > .prompts.json\n'
            "reply=$(llm_batch < .prompts.json)\n"
            'echo "$reply"\n'
            'export ANSWER_CONTENT="$(python3 -c $BASH_ROOT_PICK "$reply")"; export ANSWER_READY=1\n'
        )
        .replace("$BASH_ROOT_WINDOWS", shlex.quote(_BASH_ROOT_WINDOWS))
        .replace("$BASH_ROOT_PICK", shlex.quote(_BASH_ROOT_PICK))
    )


_BASH_ROOT_WINDOWS = (
    "import json, sys\n"
    "text = ''.join(open(p, encoding='utf-8', errors='replace').read() for p in sys.argv[2:])\n"
    "windows = [text[i : i + 20000] for i in range(0, max(len(text), 1), 19500)]\n"
    "print(json.dumps([w + '\\n\\nQuestion: ' + sys.argv[1] for w in windows]))\n"
)
_BASH_ROOT_PICK = (
    "import json, sys\n"
    "found = [a for a in json.loads(sys.argv[1]) if a.strip() and 'NOT FOUND' not in a and not a.startswith('[')]\n"
    "print(found[0] if found else 'NOT FOUND')\n"
)


def root_code_for(question: str) -> str:
    """The Python code of the root model's first turn for ``question``.

    The code expects the REPL globals ``context`` (str, list or dict), ``llm_batch`` and
    ``answer``. It cuts ``context`` into chunks of about 20,000 characters (a str in
    windows overlapping by 500 characters; a list by its items, each ``str()``-ed; a dict as
    its JSON text), asks ``llm_batch`` one prompt per chunk with ``question`` embedded
    verbatim, keeps the most common answer that is neither ``NOT FOUND`` nor an rlmq error
    string (``[error]...``, ``[rejected]...``), prints a summary and sets
    ``answer["content"]`` (``"NOT FOUND"`` when nothing was found) and
    ``answer["ready"] = True``.
    """
    return _ROOT_CODE_TEMPLATE.replace("__QUESTION__", repr(question), 1)


RECURSIVE_PARTS = 2
"""Children a recursive root (:func:`recursive_root_code_for`) starts per ``rlm_batch``."""

_RECURSIVE_ROOT_TEMPLATE = '''\
# Scripted root model (rlmq test double): rlm_batch is available at this depth, so split
# `context` in parts and give each part to a child rollout with the same question;
# keep the answer that most children agree on.
import json
from collections import Counter

question = __QUESTION__
PARTS = __PARTS__


def split(value, k):
    """k contiguous parts of a str (by lines) or a list/tuple (by items); a dict as its JSON text."""
    if isinstance(value, dict):
        value = json.dumps(value, ensure_ascii=False, indent=1)
    items = list(value) if isinstance(value, (list, tuple)) else str(value).splitlines()
    k = max(1, min(k, len(items)))
    bounds = [len(items) * i // k for i in range(k + 1)]
    parts = [items[bounds[i]:bounds[i + 1]] for i in range(k)]
    return parts if isinstance(value, (list, tuple)) else ["\\n".join(part) for part in parts]


def is_answer(reply):
    """False for NOT FOUND, an empty reply and rlmq's error strings."""
    reply = str(reply).strip()
    if reply.startswith(("[error]", "[rejected]")):
        return False
    return bool(reply) and reply.rstrip(".") != "NOT FOUND"


parts = split(context, PARTS)
replies = rlm_batch([{"prompt": question, "context": part} for part in parts])
found = [str(reply).strip() for reply in replies if is_answer(reply)]
votes = Counter(found)  # most_common keeps first-seen order among ties
best = votes.most_common(1)[0][0] if votes else "NOT FOUND"
print(f"{len(parts)} part(s) via rlm_batch, {len(found)} with an answer: {dict(votes)}")
answer["content"] = best
answer["ready"] = True
'''


def recursive_root_code_for(question: str, parts: int = RECURSIVE_PARTS) -> str:
    """The first-turn code of a root whose ``rlm_batch`` starts child rollouts (depth < ``max_depth``).

    The code expects the REPL globals ``context`` (str, list or dict), ``rlm_batch`` and
    ``answer``. It cuts ``context`` into ``min(parts, lines or items)`` contiguous parts (a str
    by lines, a list by items, a dict as its JSON text by lines), calls
    ``rlm_batch([{"prompt": question, "context": part}, ...])`` (each child, a root itself,
    answers ``question`` over its part, recursing in turn while it can), keeps the most common
    reply that is neither ``NOT FOUND`` nor an rlmq error string, prints a summary and sets
    ``answer["content"]`` (``"NOT FOUND"`` when no child found it) and ``answer["ready"] = True``.

    Args:
        question: the root's first user message, copied verbatim into every child's prompt.
        parts: children per call (at least 1).
    """
    return _RECURSIVE_ROOT_TEMPLATE.replace("__QUESTION__", repr(question), 1).replace(
        "__PARTS__", str(max(1, int(parts))), 1
    )
