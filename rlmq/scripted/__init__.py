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
    id there; requests without one count under ``""``), per model, and per role (``root``: requests
    offering ``call_python_repl`` and rlm-format roots; ``sub``: the others). See
    :meth:`ScriptedModelServer.stats`. Tokens count when the completion is returned; a client
    that disconnects first (say during a ``sleep``) cancels the call and nothing is
    counted but the request (with :class:`ScriptedModelServer` and :func:`serve`, which enable
    aiohttp's handler cancellation). Also the requests in flight now and their high-water mark
    (``in_flight``, ``in_flight_peak``), and when the last request arrived and ended.
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
  chunks agree on and sets ``answer["content"]`` and ``answer["ready"] = True``. When the
  system message says ``rlm_batch`` starts child rollouts at this depth (the line
  ``rlm_batch: recursive (depth D of M)``, ``D < M``), the code
  (:func:`~rlmq.scripted.root_script.recursive_root_code_for`) instead splits ``context`` in
  two and asks ``rlm_batch`` for one child rollout per part, with the same question; each
  child does the same one level down, and at the deepest level (``D == M``) uses ``llm_batch``
  as above. So ``rlmq demo --max-depth 3`` runs a tree of three levels without any directive.
* Later turns: plain text, ``The answer is in answer['content'].`` (no tool call).
* Offered ``call_bash_repl`` instead (the bash REPL), it is a root all the same: directives'
  code is sent as it is (write it in bash), under that tool's name; without a directive, turn 1
  is :func:`~rlmq.scripted.root_script.bash_root_code_for` (one ``llm_batch`` command over the
  start of the context files, its answer into ``ANSWER_CONTENT``, ``ANSWER_READY=1``).

Directives, read from the FIRST user message (which carries the question):

* ``[[mock:root-code:<base64>]]`` (alias ``root-code-1``): turn 1 runs exactly this code.
* ``[[mock:root-code-<k>:<base64>]]``: turn ``k`` (k >= 2) runs this code; a later turn
  without code gets plain text. Build them with :func:`root_code_directive`.
* ``[[mock:root-call-<k>:<name>:<base64 JSON>]]``: turn ``k`` calls the function tool
  ``<name>`` with these arguments instead of the REPL (``summarize_turns`` of verifiers 0.1.14's
  ``RLMEnv``, say). Build them with :func:`~rlmq.scripted.markers.root_call_directive`.
* ``[[mock:no-tool]]``: every reply is plain text, no tool call.
* ``[[mock:context-tokens:<n>]]``: a context window of ``n`` tokens (words): a request whose
  prompt tokens (counted as below) pass ``n`` is answered with HTTP 400 and vLLM's message
  ``This model's maximum context length is <n> tokens. ...`` (counted as a fault).
* ``[[mock:root-tool:<name>]]``: turn 1 calls the REPL tool ``<name>`` (an ``RLMEnv`` root
  tool) with the question (directive removed) and answers with ``str()`` of its result, or
  ``[tool failed] <message>`` when it raises.

* ``[[mock:rlm-split:<K>]]``: the recursive needle search
  (:mod:`rlmq.scripted.recursion`): turn 1 splits ``context`` into ``K`` parts and calls
  ``rlm_batch([{"prompt": <the first user message>, "context": part}, ...])`` when the system
  message has the line ``rlm_batch: recursive (depth D of M)``, else (the line
  ``rlm_batch: plain sub-LLM calls (depth D of M)``, or no such line) ``llm_batch`` with one
  ``[[mock:needle]]`` leaf prompt per part; it sets ``answer["content"]`` to the code most
  replies agree on (``none`` when none has one) and ``answer["ready"] = True``. Later turns:
  plain text. The same directive in a child's prompt makes the child do the same one level down.
  ``[[mock:rlm-split:K1,K2,K3]]`` splits by ``K1`` at depth 1, ``K2`` at depth 2 and ``K3`` at
  depth 3 and below (the depth read from that scaffold line), e.g. ``4,5,75``: 4 children, 20
  grandchildren and 1,500 leaves.

A request without tools whose system message asks for ```` ```repl ```` blocks is a root of the
RLM paper's ``rlms`` package: it gets the same search written for that package's REPL
(:func:`rlmq.scripted.recursion.rlm_format_reply`), so both systems can run one tree against
one server.

The system message of every root request is kept (the last 64) and shown in ``/stats`` as
``root_system_prompts``.

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
* ``[[mock:needle]]`` or ``[[mock:rlm-split:<K>]]``: the needle rule instead:
  the code ``X`` of the first ``the secret code is X`` in the prompt, or ``none``
  (:func:`rlmq.scripted.recursion.needle_answer`).
* ``[[mock:echo-tool-result]]``: the final answer is followed by one line
  ``tool result: <content>`` per tool message of the conversation.
* ``[[mock:spend-all]]`` (or the server option ``spend_all``): the completion is exactly
  the limit in words (``tok tok ...``), ``finish_reason: "length"``.
* ``[[mock:tokens:<n>]]`` / ``[[mock:tokens:<a>-<b>]]``: a model that stops early: the final
  answer is padded with filler words to exactly ``n`` tokens (words), or to a length drawn
  uniformly from ``a..b`` by a hash of the prompt (the same prompt always gets the same
  length; :func:`rlmq.scripted.markers.answer_tokens` gives it). A smaller limit cuts it
  (``finish_reason: "length"``); otherwise ``"stop"``.
* ``[[mock:ignore-max-tokens]]``: a server that ignores ``max_tokens``: the answer is not cut
  at the request's limit (``[[mock:tokens:300]]`` with ``max_tokens=100`` serves 300).
* ``[[mock:usage-quarter]]`` in the first user message: a server that under-reports: its
  ``usage.completion_tokens`` is a quarter of what it served (``/stats`` counts what it served).
* Token ids and logprobs (``return_token_ids``), lies included (``[[mock:token-ids:nan]]``,
  ``flood-<n>``, ...): see :mod:`rlmq.scripted.tokens`.
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

Server-wide options: ``latency`` (seconds slept before every chat completion),
``spend_all`` (sub-LLM calls only) and ``quota`` (a provider's hard quota over all callers:
requests and tokens per window answered 429 with ``Retry-After`` past it, ``rlmq mock-llm
--quota-rpm R --quota-tpm T --quota-window W``; :mod:`rlmq.scripted.quota`). Directives are
removed from a prompt before it is answered. The handler uses ``json`` and precompiled regexes only, to stay cheap under
benchmarks.

Run it alone with ``rlmq mock-llm --port P`` or ``python -m rlmq.scripted.server --port 0``
(prints ``rlmq scripted model (test double) listening on http://127.0.0.1:<port>/v1``).
"""
