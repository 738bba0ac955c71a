"""The scripted sub-LLM's answer: the fact sentence of the chunk that matches the question."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from rlmq.scripted.markers import _DIRECTIVE_RE, NOT_FOUND

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
