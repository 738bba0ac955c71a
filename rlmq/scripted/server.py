"""A scripted, OpenAI-compatible model server: a **test double**, not a language model.

``rlmq demo``, the end-to-end tests and the benchmarks use it where a real model server
(vLLM, SGLang, llama.cpp, OpenAI, ...) would otherwise be needed. It answers to any model
name, reports ``system_fingerprint: "rlmq-scripted-model"`` in every completion, and says
"test double" in its start-up line. Its answers come from fixed rules, described below.

Endpoints
---------
``POST /v1/chat/completions``
    An OpenAI chat-completions request (``model``, ``messages``, optional ``tools``,
    ``max_tokens`` / ``max_completion_tokens``, ``user``; ``stream`` must be false or
    absent). Answered with an OpenAI-shaped ``chat.completion`` object.
``GET /v1/models``
    The model names it answers to: ``rlmq-scripted-model`` plus every name seen so far
    (it answers to any name).
``GET /stats``
    Counters kept by the server itself (``DELETE /stats`` resets them): every request, and
    the tokens it served, in total, per ``user`` field value (rlmq workers send the rollout
    id there; requests without one count under ``""``) and per model. See
    :meth:`MockLLMServer.stats`. Tokens count when the completion is returned; a client
    that disconnects first (say during a ``sleep``) cancels the call and nothing is
    counted but the request (with :class:`MockLLMServer` and :func:`serve`, which enable
    aiohttp's handler cancellation).
``GET /health``
    200 ``{"status": "ok"}``.

Token accounting
----------------
A token is a whitespace-separated word: ``len(text.split())``. ``prompt_tokens`` counts the
words of every message's content. ``completion_tokens`` counts the words of the reply's
content or, for a tool call, of its ``arguments`` string (the JSON text as sent, so the
newlines of code, escaped as ``\\n``, do not separate words). The limit is the request's
``max_completion_tokens`` or ``max_tokens`` (the smaller when both are given;
:data:`DEFAULT_MAX_TOKENS` when neither is). A longer reply is cut to that many words and
gets ``finish_reason: "length"``; a cut tool call is returned as plain content (its
truncated arguments text) without ``tool_calls``, as a real server's tool parser would.
A limit of 0 or less, or one that is not an integer, is answered with HTTP 400 and an
OpenAI-style error body. So ``completion_tokens`` never exceeds the limit.

As the ROOT model (a tool named ``call_python_repl`` is offered)
-----------------------------------------------------------------
Turn ``k`` is one plus the number of assistant messages in the conversation.

* Turn 1: one ``call_python_repl`` tool call whose code (:func:`root_code_for`) splits
  ``context`` into chunks, asks ``llm_batch`` one prompt per chunk, takes the answer most
  chunks agree on and sets ``answer["content"]`` and ``answer["ready"] = True``.
* Later turns: plain text, ``The answer is in answer['content'].`` (no tool call).

Directives, read from the FIRST user message (which carries the question):

* ``[[mock:root-code:<base64>]]`` (alias ``root-code-1``): turn 1 runs exactly this code.
* ``[[mock:root-code-<k>:<base64>]]``: turn ``k`` (k >= 2) runs this code; a later turn
  without code gets plain text. Build them with :func:`root_code_directive`.
* ``[[mock:no-tool]]``: every reply is plain text, no tool call.

Because the turn-1 script copies the question verbatim into every sub-LLM prompt, sub-LLM
directives written into the question reach every sub-LLM call of the rollout.

As a SUB-LLM (no ``call_python_repl`` tool)
-------------------------------------------
The prompt is the text of the last user message; the answer is
:func:`answer_from_chunk` of it: the fact sentence of the chunk that matches the question,
reduced to the part after `` is ``/`` was ``/``: ``..., or exactly ``NOT FOUND``.
Directives in the prompt:

* ``[[mock:tool:<name>:<json-args>]]`` (only when the request offers ``tools``): the
  first turn replies with that tool call (``finish_reason: "tool_calls"``; the name need
  not be among the offered tools, the arguments are sent verbatim and may be invalid JSON
  on purpose; they must not contain ``]]``). With several of them,
  turn ``k`` (one plus the assistant messages so far) calls the k-th; after the last,
  the model answers normally.
* ``[[mock:echo-tool-result]]``: the final answer is followed by one line
  ``tool result: <content>`` per tool message of the conversation.
* ``[[mock:spend-all]]`` (or the server option ``spend_all``): the completion is exactly
  the limit in words (``tok tok ...``), ``finish_reason: "length"``.
* ``[[mock:tokens:<n>]]`` / ``[[mock:tokens:<a>-<b>]]``: a model that stops early: the final
  answer is padded with filler words to exactly ``n`` tokens (words), or to a length drawn
  uniformly from ``a..b`` by a hash of the prompt (the same prompt always gets the same
  length; :func:`answer_tokens` gives it). A smaller limit cuts it (``finish_reason:
  "length"``); otherwise ``"stop"``. See :func:`answer_tokens`.
* Faults, for resilience tests:
  ``[[mock:status:<code>]]`` / ``[[mock:status:<code>:retry-after=<seconds>]]`` (HTTP error
  with an OpenAI-style body, and a ``Retry-After`` header when given);
  ``[[mock:malformed]]`` (200 with a body that is not JSON);
  ``[[mock:reset]]`` (the connection is closed without a response);
  ``[[mock:sleep:<seconds>]]`` (waits before answering);
  ``[[mock:no-usage]]`` (a valid completion without ``usage``; its tokens still count in
  ``/stats``). Each applies to every attempt, or only to the first ``N`` attempts of the
  same prompt text with ``[[mock:fail-times:<N>]]``. Order: sleep, then reset, then
  status, then malformed.

Server-wide options: ``latency`` (seconds slept before every chat completion) and
``spend_all`` (sub-LLM calls only). Directives are removed from a prompt before it is
answered. The handler uses ``json`` and precompiled regexes only, to stay cheap under
benchmarks.

Run it alone with ``rlmq mock-llm --port P`` or ``python -m rlmq.scripted.server --port 0``
(prints ``rlmq scripted model (test double) listening on http://127.0.0.1:<port>/v1``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import itertools
import json
import logging
import re
import signal
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MODEL_FINGERPRINT",
    "NOT_FOUND",
    "ROOT_TOOL_NAME",
    "MockLLMServer",
    "answer_from_chunk",
    "answer_tokens",
    "create_app",
    "main",
    "root_code_directive",
    "root_code_for",
    "serve",
]

log = logging.getLogger(__name__)

MODEL_FINGERPRINT = "rlmq-scripted-model"
"""``system_fingerprint`` of every completion, and the first name in ``GET /v1/models``."""
ROOT_TOOL_NAME = "call_python_repl"
NOT_FOUND = "NOT FOUND"
DEFAULT_MAX_TOKENS = 4096
"""Completion limit in tokens (words) when a request gives neither max_tokens nor max_completion_tokens."""
ROOT_FOLLOW_UP = "The answer is in answer['content']."
NO_TOOL_REPLY = "The scripted model answers without the REPL: NOT FOUND"
LISTEN_LINE = "rlmq scripted model (test double) listening on {url}"

# --------------------------------------------------------------------------------------
# Directives
# --------------------------------------------------------------------------------------

_DIRECTIVE_RE = re.compile(r"\[\[mock:.*?\]\]", re.DOTALL)
_ROOT_CODE_RE = re.compile(r"\[\[mock:root-code(?:-(\d+))?:([A-Za-z0-9+/=_\-\s]*)\]\]")
_TOOL_RE = re.compile(r"\[\[mock:tool:([^:\]\s]+):(.*?)\]\]", re.DOTALL)
_STATUS_RE = re.compile(r"\[\[mock:status:(\d{3})(?::retry-after=(\d+(?:\.\d+)?))?\]\]")
_SLEEP_RE = re.compile(r"\[\[mock:sleep:(\d+(?:\.\d+)?)\]\]")
_FAIL_TIMES_RE = re.compile(r"\[\[mock:fail-times:(\d+)\]\]")
_TOKENS_RE = re.compile(r"\[\[mock:tokens:(\d+)(?:-(\d+))?\]\]")


def root_code_directive(code: str, turn: int = 1) -> str:
    """The directive that makes root turn ``turn`` (1-based) run exactly ``code``.

    Put it in the question (the first user message) of a rollout.
    """
    encoded = base64.b64encode(code.encode("utf-8")).decode("ascii")
    suffix = "" if turn == 1 else f"-{turn}"
    return f"[[mock:root-code{suffix}:{encoded}]]"


def _decode_b64(data: str) -> str:
    data = "".join(data.split())
    data += "=" * (-len(data) % 4)
    try:
        if "-" in data or "_" in data:
            return base64.urlsafe_b64decode(data).decode("utf-8")
        return base64.b64decode(data, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"bad base64 in root-code directive: {exc}") from exc


def _root_codes(first_user: str) -> dict[int, str]:
    codes: dict[int, str] = {}
    for match in _ROOT_CODE_RE.finditer(first_user):
        turn = int(match.group(1)) if match.group(1) else 1
        codes[turn] = _decode_b64(match.group(2))
    return codes


@dataclass(frozen=True, slots=True)
class _Faults:
    sleep: float | None = None
    reset: bool = False
    status: int | None = None
    retry_after: str | None = None
    malformed: bool = False
    no_usage: bool = False
    fail_times: int | None = None

    @property
    def any(self) -> bool:
        return self.sleep is not None or self.reset or self.status is not None or self.malformed or self.no_usage


def _parse_faults(prompt: str) -> _Faults:
    status = _STATUS_RE.search(prompt)
    sleep = _SLEEP_RE.search(prompt)
    fail_times = _FAIL_TIMES_RE.search(prompt)
    return _Faults(
        sleep=float(sleep.group(1)) if sleep else None,
        reset="[[mock:reset]]" in prompt,
        status=int(status.group(1)) if status else None,
        retry_after=status.group(2) if status else None,
        malformed="[[mock:malformed]]" in prompt,
        no_usage="[[mock:no-usage]]" in prompt,
        fail_times=int(fail_times.group(1)) if fail_times else None,
    )


# --------------------------------------------------------------------------------------
# Root model: the chunking script
# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------
# Sub-LLM: answering from a chunk
# --------------------------------------------------------------------------------------

_WORD_RE = re.compile(r"\w(?:[\w'’\-]*\w)?")
_SENTENCE_SPLIT_RE = re.compile(  # not after "Dr." "e.g." "J." ...
    r"(?<=[.!?])(?<!\bDr\.)(?<!\bMr\.)(?<!\bMs\.)(?<!\bMrs\.)(?<!\bSt\.)(?<!\bvs\.)(?<!\bNo\.)"
    r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\b[A-Z]\.)\s+"
)
_PARAGRAPH_SPLIT_RE = re.compile(r"\n\s*\n")
_COPULA_RE = re.compile(r"\s(?:is|was|are|were|equals|(?:has|have|had)(?:\s+been)?)(?:\s*:)?\s+|:\s+|\s=\s+")
_RELATIVE_RE = re.compile(r"\b(?:which|that|who|whom)\s*$", re.IGNORECASE)
_CLAUSE_END_RE = re.compile(r",\s|;\s|\s\(|\s[—–]\s|\s-\s|\s\||[.!?](?:\s|$)")
_PASSIVE_RE = re.compile(
    r"(?:\w{3,}ed|written|made|built|known|given|taken|born|held|kept|sold|won|drawn|chosen|seen|found|hidden"
    r"|stolen|sent|set|left|lost|paid|told|brought|bought|taught|led|shown|grown|thrown|worn)\s+"
    r"(?:(?:by|in|at|on|as|to|from|for|with|into|under|near)\s+|(?=(?:the|a|an)\s|[A-Z0-9\"'“‘]))"
)
_CLAUSE_START_RE = re.compile(r".*(?:[,;:|()\[\]{}<>]|[.!?]\s|\s[-—–]\s)", re.DOTALL)
_LEADING_WORD_RE = re.compile(r"\s*(\w(?:[\w'’\-]*\w)?)\s*")
_QUESTION_LABEL_RE = re.compile(r"^\s*(?:question|q)\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_TEXT_LABEL_RE = re.compile(
    r"^\s*(?:text|context|document|passage|chunk|excerpt)\s*:[ \t]*\n?", re.IGNORECASE | re.MULTILINE
)
_NONSPACE_RE = re.compile(r"\S+")
_STRIP_CHARS = " \t\r\n.,;:!?\"'`“”‘’*"

_ID_WEIGHT = 3
_MIN_WEIGHTED_COVER = 0.6
_MIN_WORD_COVER = 0.5

_STOPWORDS = frozenset(
    """
    a about above according after again against all also am an and any are aren't as at be
    because been before being below between both but by can cannot could couldn't did didn't
    do does doesn't doing don't down during each either else ever every few for from further
    had hadn't has hasn't have haven't having he her here hers herself him himself his how i
    if in into is isn't it it's its itself just let me more most much must my myself no nor
    not now of off on once one only or other ought our ours ourselves out over own same shall
    she should shouldn't so some such than that that's the their theirs them themselves then
    there there's these they this those through thus to too under until up upon us very was
    wasn't we were weren't what what's when when's where where's whether which while who
    who's whom whose why why's will with within without won't would wouldn't yet you your
    yours yourself yourselves
    answer answers reply replies respond return give tell provide please exactly word words
    only just single short brief simply text context document passage excerpt chunk question
    following below above based find say said
    """.split()
)


def _norm(token: str) -> str:
    word = token.lower()
    if word.endswith(("'s", "’s")):
        word = word[:-2]
    if len(word) > 4 and word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    elif len(word) > 5 and word.endswith(("ed", "ing")):  # founded ~ found, signed ~ sign
        word = word[:-2] if word.endswith("ed") else word[:-3]
    return word


def _is_identifier(token: str, sentence_initial: bool) -> bool:
    if any(ch.isdigit() for ch in token) or "-" in token or "_" in token:
        return True
    if len(token) >= 2 and token.isupper():
        return True
    if any(ch.isupper() for ch in token[1:]):
        return True
    return token[0].isupper() and not sentence_initial


@dataclass(slots=True)
class _QuestionTerms:
    ids: set[str]  # proper nouns, identifiers, numbers: weight _ID_WEIGHT
    words: set[str]  # other content words: weight 1
    all_words: set[str]  # every word of the question, stopwords included

    @property
    def total(self) -> int:
        return _ID_WEIGHT * len(self.ids) + len(self.words)

    def weight(self, terms: set[str]) -> int:
        return _ID_WEIGHT * len(self.ids & terms) + len(self.words & terms)

    def accepts(self, terms: set[str]) -> bool:
        if self.ids and not self.ids & terms:
            return False
        # half of the other words, unless the question has only one (then the names decide)
        if len(self.words) > 1 and len(self.words & terms) < _MIN_WORD_COVER * len(self.words):
            return False
        return self.weight(terms) >= _MIN_WEIGHTED_COVER * self.total


def _question_terms(question: str) -> _QuestionTerms:
    ids: set[str] = set()
    words: set[str] = set()
    all_words: set[str] = set()
    for match in _WORD_RE.finditer(question):
        token = match.group(0)
        word = _norm(token)
        all_words.add(word)
        if word in _STOPWORDS:
            continue
        start = match.start()
        before = question[max(0, start - 8) : start].rstrip()
        initial = before[-1:] in ".?!:\"'([“‘" if before else start < 8 or "\n" in question[start - 8 : start]
        if _is_identifier(token, initial):
            ids.add(word)
        elif len(word) >= 3:
            words.add(word)
    return _QuestionTerms(ids, words, all_words)


def _split_prompt(prompt: str) -> tuple[str, str]:
    """(question, chunk) of a sub-LLM prompt."""
    start = prompt.find("<question>")
    if start >= 0:
        end = prompt.find("</question>", start)
        if end >= 0:
            question = prompt[start + len("<question>") : end]
            text_start = prompt.find("<text>", end)
            if text_start < 0:
                return question, prompt[:start] + prompt[end + len("</question>") :]
            text_end = prompt.rfind("</text>")
            if text_end < text_start:
                text_end = len(prompt)
            return question, prompt[text_start + len("<text>") : text_end]
    label = _QUESTION_LABEL_RE.search(prompt)
    if label is not None:
        rest = prompt[: label.start()] + "\n" + prompt[label.end() :]
        text = _TEXT_LABEL_RE.search(rest)
        return label.group(1), rest[text.end() :] if text else rest
    lines = prompt.splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if not filled:
        return "", ""
    asks = [i for i in filled if "?" in lines[i]]
    if filled[0] in asks:
        pick = filled[0]
    elif filled[-1] in asks:
        pick = filled[-1]
    elif asks:
        pick = asks[0]
    else:
        pick = filled[0]
    line = lines[pick]
    end = line.rfind("?") + 1  # text after the question mark ("Reply with ... only.") is not the question
    question, rest = (line[:end], line[end:]) if end else (line, "")
    return question, "\n".join([*lines[:pick], rest, *lines[pick + 1 :]])


def _sentences(text: str, *, paragraphs: bool = False) -> Iterator[str]:
    blocks = (" ".join(p.split()) for p in _PARAGRAPH_SPLIT_RE.split(text)) if paragraphs else text.splitlines()
    for block in blocks:
        for sentence in _SENTENCE_SPLIT_RE.split(block):
            sentence = sentence.strip()
            if sentence and not sentence.endswith("?"):
                yield sentence


def _terms(text: str) -> set[str]:
    return {_norm(token) for token in _WORD_RE.findall(text)}


def _best_sentence(chunk: str, terms: _QuestionTerms, *, paragraphs: bool) -> str | None:
    best: str | None = None
    best_weight = 0
    ids = terms.ids
    for sentence in _sentences(chunk, paragraphs=paragraphs):
        if ids:
            lowered = sentence.lower()
            if not any(i in lowered for i in ids):
                continue
        found = _terms(sentence)
        weight = terms.weight(found)
        if weight > best_weight and terms.accepts(found):
            best, best_weight = sentence, weight
    return best


def _clean(text: str) -> str:
    return text.strip(_STRIP_CHARS)


def _after_copula(rest: str, question_words: set[str]) -> str:
    cut = _CLAUSE_END_RE.search(rest)
    if cut is not None:
        rest = rest[: cut.start()]
    rest = _clean(rest)
    passive = _PASSIVE_RE.match(rest)  # "was [signed in] Port Alric", "was [written by] Ines Halvorsen"
    stripped = rest[passive.end() :] if passive else rest
    while True:
        lead = _LEADING_WORD_RE.match(stripped)
        if lead is None or _norm(lead.group(1)) not in question_words:
            break
        stripped = stripped[lead.end() :]
    stripped = _clean(stripped)
    return stripped or rest


def _extract(sentence: str, terms: _QuestionTerms) -> str:
    matched = terms.ids | terms.words
    hits = [m for m in _WORD_RE.finditer(sentence) if _norm(m.group(0)) in matched]
    copulas = [m for m in _COPULA_RE.finditer(sentence) if not _RELATIVE_RE.search(sentence[: m.start()])]
    # 1. "<matched words> is <answer>": the copula with the most matched weight before it
    ranked = sorted(
        ((terms.weight(_terms(sentence[: c.start()])), c.start(), c) for c in copulas),
        key=lambda item: (-item[0], item[1]),
    )
    for weight, _, copula in ranked:
        if weight > 0:
            candidate = _after_copula(sentence[copula.end() :], terms.all_words)
            if candidate:
                return candidate
    # 2. "<answer> is the <matched words>": a copula just before the first matched word
    if hits:
        before = [c for c in copulas if c.end() <= hits[0].start()]
        if before and len(sentence[before[-1].end() : hits[0].start()].split()) <= 3:
            start = before[-2].end() if len(before) > 1 else 0
            prefix = sentence[start : before[-1].start()]
            lead = _CLAUSE_START_RE.match(prefix)  # drop what precedes the answer's own clause
            candidate = _clean(prefix[lead.end() :] if lead else prefix)
            if candidate:
                return candidate
        # 3. "<matched words> founded ... in <answer>": what follows the last matched word
        candidate = _after_copula(sentence[hits[-1].end() :], terms.all_words)
        if _terms(candidate) - terms.all_words:
            return candidate
    # 4. the whole sentence
    return _clean(sentence) or sentence


def _answer(question: str, chunk: str) -> str:
    terms = _question_terms(question)
    if not terms.total:
        return NOT_FOUND
    lowered = chunk.lower()
    present = {t for t in terms.ids | terms.words if t in lowered}
    if not terms.accepts(present):  # quick exit: the chunk cannot hold a matching sentence
        return NOT_FOUND
    sentence = _best_sentence(chunk, terms, paragraphs=False)
    if sentence is None and "\n" in chunk:  # a fact sentence wrapped over several lines
        sentence = _best_sentence(chunk, terms, paragraphs=True)
    if sentence is None:
        return NOT_FOUND
    return _extract(sentence, terms)


def answer_from_chunk(prompt: str) -> str:
    """The sub-LLM rule: answer the question of ``prompt`` from the text in it, or ``NOT FOUND``.

    The question and the text are told apart by ``<question>...</question>`` and
    ``<text>...</text>`` tags (what :func:`root_code_for` writes), else by ``Question:`` and
    ``Text:``/``Context:`` labels, else the first (or last) line with a ``?`` is the question
    and the rest is the text. ``[[mock:...]]`` directives are ignored.

    The question's content words (lowercased, stopwords removed, at least 3 letters) are
    weighted 1, its names and identifiers (capitalised words not starting a sentence,
    all-caps words, words with digits, hyphens or underscores) 3. The best-scoring sentence
    or line of the text that has at least one of the names, half of the other words, and
    60 % of the total weight, is the fact; the answer is the part of it after the
    `` is ``/`` was ``/`` are ``/`` were ``/`` has ``/``: `` that follows the matched words (up to a
    comma, without trailing punctuation or leading words of the question), the part before
    it when the sentence reads "<answer> is the ...", or else the whole sentence.
    Deterministic; no sentence matching enough gives exactly ``NOT FOUND``.

    >>> answer_from_chunk("What is the code of vault ORCHID?\\nBlah. The code of vault ORCHID is 48213.")
    '48213'
    """
    if "[[mock:" in prompt:
        prompt = _DIRECTIVE_RE.sub(" ", prompt)
    question, chunk = _split_prompt(prompt)
    return _answer(question, chunk)


# --------------------------------------------------------------------------------------
# Request handling
# --------------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def _words(text: str) -> int:
    return len(text.split())


def _truncate(text: str, limit: int) -> str:
    """The first ``limit`` whitespace-separated words of ``text``, spacing kept."""
    end = 0
    for count, match in enumerate(_NONSPACE_RE.finditer(text), start=1):
        end = match.end()
        if count >= limit:
            break
    return text[:end]


@dataclass(slots=True)
class _Reply:
    content: str | None = None
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    completions: int = 0
    faults: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "completions": self.completions,
            "faults": self.faults,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


class _State:
    def __init__(self, latency: float, spend_all: bool) -> None:
        self.latency = latency
        self.spend_all = spend_all
        self.started = time.time()
        self.ids = itertools.count(1)
        self.attempts: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        self.total = _Counts()
        self.invalid = 0
        self.per_user: dict[str, _Counts] = {}
        self.per_model: dict[str, _Counts] = {}
        self.attempts.clear()

    def counters(self, user: str, model: str) -> tuple[_Counts, _Counts, _Counts]:
        per_user = self.per_user.get(user)
        if per_user is None:
            per_user = self.per_user[user] = _Counts()
        per_model = self.per_model.get(model)
        if per_model is None:
            per_model = self.per_model[model] = _Counts()
        return self.total, per_user, per_model

    def snapshot(self) -> dict[str, Any]:
        return {
            "server": f"{MODEL_FINGERPRINT} (test double)",
            **self.total.as_dict(),
            "invalid_requests": self.invalid,
            "per_user": {k: v.as_dict() for k, v in self.per_user.items()},
            "per_model": {k: v.as_dict() for k, v in self.per_model.items()},
        }


_STATE = web.AppKey("rlmq_mock_llm_state", _State)
_JSON = "application/json"


def _error(
    status: int, message: str, *, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=_JSON, headers=headers)


def _limit_of(body: dict[str, Any]) -> int | str:
    """The completion limit in tokens, or an error message."""
    limits: list[int] = []
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer, got {value!r}"
        if value <= 0:
            return f"{key} must be at least 1, got {value}"
        limits.append(value)
    return min(limits) if limits else DEFAULT_MAX_TOKENS


def _tool_names(tools: Any) -> list[str]:
    names: list[str] = []
    if isinstance(tools, list):
        for tool in tools:
            if isinstance(tool, dict):
                function = tool.get("function")
                if isinstance(function, dict) and isinstance(function.get("name"), str):
                    names.append(function["name"])
    return names


def _root_reply(messages: Sequence[dict[str, Any]]) -> _Reply:
    first_user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
    if "[[mock:" in first_user:
        if "[[mock:no-tool]]" in first_user:
            return _Reply(content=NO_TOOL_REPLY)
        code = _root_codes(first_user).get(turn)
        if code is not None:
            return _Reply(tool_calls=[(ROOT_TOOL_NAME, json.dumps({"code": code}))])
    if turn == 1:
        return _Reply(tool_calls=[(ROOT_TOOL_NAME, json.dumps({"code": root_code_for(first_user)}))])
    return _Reply(content=ROOT_FOLLOW_UP)


def _sub_reply(messages: Sequence[dict[str, Any]], prompt: str, offers_tools: bool) -> _Reply:
    if "[[mock:" in prompt:
        if offers_tools:
            directives = _TOOL_RE.findall(prompt)
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            if turn < len(directives):
                name, arguments = directives[turn]
                return _Reply(tool_calls=[(name, arguments)])
        content = answer_from_chunk(prompt)
        if "[[mock:echo-tool-result]]" in prompt:
            results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
            content = "\n".join([content, *(f"tool result: {r}" for r in results)])
        return _Reply(content=content)
    return _Reply(content=answer_from_chunk(prompt))


def answer_tokens(prompt: str) -> int | None:
    """The answer length (tokens = words) a ``[[mock:tokens:...]]`` directive in ``prompt`` asks for.

    ``[[mock:tokens:250]]`` gives 250; ``[[mock:tokens:1-400]]`` gives a length in 1..400 drawn
    by the CRC-32 of the whole prompt (deterministic, so a test can add up its demand).
    ``None`` when the prompt has no such directive.
    """
    match = _TOKENS_RE.search(prompt)
    if match is None:
        return None
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if high <= low:
        return max(1, low)
    return max(1, low + zlib.crc32(prompt.encode()) % (high - low + 1))


def _completion(state: _State, reply: _Reply, limit: int, spend_all: bool) -> tuple[dict[str, Any], int]:
    """The OpenAI message, finish_reason and completion tokens of ``reply``."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if spend_all:
        message["content"] = " ".join(["tok"] * limit)
        return {"message": message, "finish_reason": "length"}, limit
    used = _words(reply.content or "") + sum(_words(args) for _, args in reply.tool_calls)
    if used > limit:
        text = reply.tool_calls[0][1] if reply.tool_calls else reply.content or ""
        message["content"] = _truncate(text, limit)
        return {"message": message, "finish_reason": "length"}, _words(message["content"])
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_mock_{next(state.ids)}",
                "type": "function",
                "function": {"name": n, "arguments": a},
            }
            for n, a in reply.tool_calls
        ]
        return {"message": message, "finish_reason": "tool_calls"}, used
    return {"message": message, "finish_reason": "stop"}, used


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    try:
        body = json.loads(await request.read())
    except ValueError:
        state.invalid += 1
        return _error(400, "the request body is not valid JSON")
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        state.invalid += 1
        return _error(400, "'messages' must be a non-empty list of message objects")
    if body.get("stream"):
        state.invalid += 1
        return _error(400, "stream is not supported by the rlmq scripted model")
    limit = _limit_of(body)
    if isinstance(limit, str):
        state.invalid += 1
        return _error(400, limit)
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    user = body.get("user")
    user = user if isinstance(user, str) else ""
    total, per_user, per_model = state.counters(user, model)
    for counts in (total, per_user, per_model):
        counts.requests += 1

    if state.latency > 0:
        await asyncio.sleep(state.latency)

    tool_names = _tool_names(body.get("tools"))
    no_usage = False
    spend_all = False
    if ROOT_TOOL_NAME in tool_names:
        try:
            reply = _root_reply(messages)
        except ValueError as exc:  # a root-code directive that does not decode
            return _error(400, str(exc))
    else:
        prompt = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        if "[[mock:" in prompt:
            faults = _parse_faults(prompt)
            active = faults.any
            if active and faults.fail_times is not None:
                attempt = state.attempts[prompt] = state.attempts.get(prompt, 0) + 1
                active = attempt <= faults.fail_times
            if active:
                failed = await _apply_faults(request, faults)
                if failed is not None:
                    for counts in (total, per_user, per_model):
                        counts.faults += 1
                    return failed
                no_usage = faults.no_usage
            spend_all = "[[mock:spend-all]]" in prompt
        spend_all = spend_all or state.spend_all
        reply = _sub_reply(messages, prompt, bool(tool_names))
        length = answer_tokens(prompt) if "[[mock:tokens:" in prompt else None
        if length is not None and not reply.tool_calls:
            words = (reply.content or "").split()[:length]
            reply = _Reply(content=" ".join(words + ["tok"] * (length - len(words))))

    choice, completion_tokens = _completion(state, reply, limit, spend_all)
    prompt_tokens = sum(_words(_text(m.get("content"))) for m in messages)
    for counts in (total, per_user, per_model):
        counts.completions += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion_tokens
    result: dict[str, Any] = {
        "id": f"chatcmpl-mock-{next(state.ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": MODEL_FINGERPRINT,
        "choices": [{"index": 0, **choice, "logprobs": None}],
    }
    if not no_usage:
        result["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return web.Response(body=json.dumps(result).encode(), content_type=_JSON)


async def _apply_faults(request: web.Request, faults: _Faults) -> web.StreamResponse | None:
    """Sleep, then the failure response to send (None: answer normally)."""
    if faults.sleep is not None:
        await asyncio.sleep(faults.sleep)
    if faults.reset:
        transport = request.transport
        if transport is not None:
            transport.abort()
        return web.Response(status=499)  # never sent: the connection is gone
    if faults.status is not None:
        headers = {"Retry-After": faults.retry_after} if faults.retry_after is not None else None
        kind = "rate_limit_error" if faults.status == 429 else "server_error"
        return _error(faults.status, f"[[mock:status:{faults.status}]] scripted failure", kind=kind, headers=headers)
    if faults.malformed:
        return web.Response(body=b"{this is not JSON: [[mock:malformed]]", content_type=_JSON)
    return None


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    names = [MODEL_FINGERPRINT, *(name for name in state.per_model if name and name != MODEL_FINGERPRINT)]
    created = int(state.started)
    data = [{"id": n, "object": "model", "created": created, "owned_by": "rlmq-test-double"} for n in names]
    return web.json_response({"object": "list", "data": data})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].snapshot())


async def _reset_stats(request: web.Request) -> web.Response:
    request.app[_STATE].reset()
    return web.json_response(request.app[_STATE].snapshot())


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "server": f"{MODEL_FINGERPRINT} (test double)"})


def create_app(*, latency: float = 0.0, spend_all: bool = False) -> web.Application:
    """The aiohttp application of the scripted model.

    ``latency``: seconds slept before answering every chat completion (simulates a slow
    model). ``spend_all``: every sub-LLM completion is exactly its limit in tokens (words).
    """
    if latency < 0:
        raise ValueError("latency must be >= 0 seconds")
    app = web.Application()
    app[_STATE] = _State(latency, spend_all)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", _chat_completions)
        app.router.add_get(f"{prefix}/models", _models)
    app.router.add_get("/stats", _stats)
    app.router.add_delete("/stats", _reset_stats)
    app.router.add_get("/health", _health)
    return app


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class MockLLMServer:
    """Async context manager running the scripted server (a test double) in the current event loop.

    ``port=0`` lets the OS pick a free port; read it from :attr:`port` or :attr:`url`
    after :meth:`start`. ``latency`` is in seconds; ``spend_all`` makes every sub-LLM
    completion exactly its limit in tokens (words)::

        async with MockLLMServer() as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, latency: float = 0.0, spend_all: bool = False
    ) -> None:
        self._host = host
        self._requested_port = port
        self._port: int | None = None
        self._app = create_app(latency=latency, spend_all=spend_all)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; returns once the socket listens."""
        if self._runner is not None:
            return
        runner = web.AppRunner(self._app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._requested_port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        log.info(LISTEN_LINE.format(url=self.url))

    async def stop(self) -> None:
        """Stop serving and close the socket (open requests are cancelled)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> MockLLMServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port (after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("the scripted model server is not started")
        return self._port

    @property
    def url(self) -> str:
        """The OpenAI ``base_url``: ``http://<host>:<port>/v1``."""
        return _url(self._host, self.port)

    @property
    def stats(self) -> dict[str, Any]:
        """A copy of the server's counters (the body of ``GET /stats``).

        Keys: ``requests`` (chat completions accepted, faults included), ``completions``
        (200 answers with a completion), ``faults`` (scripted failures), ``prompt_tokens``
        and ``completion_tokens`` (tokens = words, of the completions served),
        ``invalid_requests`` (answered 400), and ``per_user`` / ``per_model``: the same five
        counters per ``user`` field value (``""`` when absent) and per requested model name.
        """
        return self._app[_STATE].snapshot()

    def reset_stats(self) -> None:
        """Zero every counter (like ``DELETE /stats``), including fail-times attempt counts."""
        self._app[_STATE].reset()


async def _serve(host: str, port: int, latency: float, spend_all: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    async with MockLLMServer(host, port, latency=latency, spend_all=spend_all) as server:
        print(LISTEN_LINE.format(url=server.url), flush=True)
        await stop.wait()


def serve(host: str, port: int, *, latency: float = 0.0, spend_all: bool = False) -> None:
    """Run the scripted model (a test double) until SIGINT or SIGTERM; blocking.

    Prints ``rlmq scripted model (test double) listening on http://<host>:<port>/v1`` to
    stdout, flushed, with the port actually bound (so ``port=0`` works for a parent process
    reading that line). ``latency`` is in seconds.
    """
    try:
        asyncio.run(_serve(host, port, latency, spend_all))
    except KeyboardInterrupt:  # pragma: no cover - a second Ctrl-C
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlmq.scripted.server [--host H] [--port P] [--latency S] [--spend-all]``."""
    parser = argparse.ArgumentParser(description="rlmq scripted OpenAI-compatible model (a test double)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds slept per chat completion")
    parser.add_argument("--spend-all", action="store_true", help="sub-LLM completions use their whole limit")
    args = parser.parse_args(argv)
    serve(args.host, args.port, latency=args.latency, spend_all=args.spend_all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
