"""``repl_output_format="reference"``: a Python cell's output reads as verifiers 0.1.14's
``RLMEnv`` wrote it (``stdout``, then ``stderr:`` and what the cell wrote to ``sys.stderr``,
then ``Out[n]: repr`` or the traceback; ``(no output)`` for a silent cell). The default,
``"rlmq"``, is unchanged."""

from __future__ import annotations

from typing import Any

from rlmq.producer.repl import Repl

UNUSED_URL = "http://127.0.0.1:9/llm_batch"


def _repl(**kwargs: Any) -> Repl:
    return Repl(context="ctx", endpoint_url=UNUSED_URL, token="t" * 32, **kwargs)


async def test_reference_format_labels_stderr_numbers_values_and_names_silence() -> None:
    async with _repl(output_format="reference") as r:
        assert (await r.execute("x = 1")).output == "(no output)"
        assert (await r.execute("x + 1")).output == "Out[2]: 2\n"
        cell = "import sys\nprint('hello')\nprint('careful', file=sys.stderr)\n[x, 'a']"
        assert (await r.execute(cell)).output == "hello\nstderr:\ncareful\nOut[3]: [1, 'a']\n"
        failed = (await r.execute("print('before')\n1 / 0")).output
        assert failed.startswith("before\nTraceback") and "ZeroDivisionError" in failed and "Out[" not in failed


async def test_the_default_format_is_unchanged() -> None:
    async with _repl() as r:
        assert (await r.execute("x = 1")).output == ""
        assert (await r.execute("x + 1")).output == "2\n"


async def test_without_sub_llms_neither_repl_has_llm_batch() -> None:
    """``enable_sub_llms=False`` (``sub_llms=False``): no ``llm_batch`` / ``rlm_batch`` global nor command."""
    async with _repl(sub_llms=False) as r:
        assert (await r.execute("print('llm_batch' in globals(), 'rlm_batch' in globals())")).output == "False False\n"
    async with _repl(sub_llms=False, language="bash") as r:
        out = (await r.execute("type llm_batch >/dev/null 2>&1; echo $?")).output
        assert out.strip().splitlines()[-1] != "0", out
    async with _repl(language="bash") as r:
        assert (await r.execute("type llm_batch >/dev/null 2>&1; echo $?")).output.strip().splitlines()[-1] == "0"
