"""The root model client (producer/root.py) tells a prompt refused for its length from other errors."""

from __future__ import annotations

import pytest

from rlmq.common.errors import ModelError, PromptTooLongError
from rlmq.producer.root import RootModel, prompt_too_long
from rlmq.producer.scaffold import REPL_TOOL
from rlmq.scripted.server import ScriptedModelServer


@pytest.mark.parametrize(
    "text",
    [
        # OpenAI
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
        "{'error': {'code': 'context_length_exceeded', 'message': 'too many'}}",
        "Your input exceeds the context window of this model. Please adjust your input and try again.",
        # vLLM (old and new wording)
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the "
        "messages, 1000 in the completion).",
        "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
        # SGLang
        "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
        # llama.cpp server
        "the request exceeds the available context size, try increasing it",
        "{'error': {'type': 'exceed_context_size_error', 'n_prompt_tokens': 5000, 'n_ctx': 4096}}",
        # text-generation-inference
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens",
        # verifiers' renderer (relayed by its interception server), Anthropic-style proxies
        "Prompt length (5000) exceeds maximum context length (4096).",
        "prompt is too long: 210000 tokens > 200000 maximum",
    ],
)
def test_context_length_refusals_of_known_servers_are_recognised(text: str) -> None:
    assert prompt_too_long(400, text)
    assert not prompt_too_long(500, text)  # only a refusal of the request, never a server failure


@pytest.mark.parametrize(
    "text",
    [
        "max_tokens must be at least 1, got 0",
        "Invalid 'messages[1].tool_calls': empty array.",
        "The model `gpt-5` does not exist or you do not have access to it.",
    ],
)
def test_other_refusals_are_not(text: str) -> None:
    assert not prompt_too_long(400, text)


async def test_the_client_raises_prompt_too_long_for_the_servers_refusal() -> None:
    async with ScriptedModelServer() as server:
        root = RootModel(server.url, retries=2)
        try:
            long_question = "[[mock:context-tokens:50]] " + "word " * 60
            with pytest.raises(PromptTooLongError, match="refused the prompt for its length.*maximum context") as info:
                await root.chat(model="m", messages=[{"role": "user", "content": long_question}], tools=[REPL_TOOL])
            assert info.value.status == 400
            assert server.stats["requests"] == 1  # not retried: the same prompt is refused again
            short = "[[mock:context-tokens:50]] " + "word " * 10
            reply = await root.chat(model="m", messages=[{"role": "user", "content": short}], tools=[REPL_TOOL])
            assert reply.choices[0].message.tool_calls
            # any other 400 stays a plain model error
            with pytest.raises(ModelError) as other:
                await root.chat(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=0)
            assert not isinstance(other.value, PromptTooLongError)
        finally:
            await root.close()
