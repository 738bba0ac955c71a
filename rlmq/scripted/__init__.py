"""The scripted model: an OpenAI-compatible server that is a test double, not a language model.

``rlmq mock-llm`` and ``rlmq demo`` run it; the tests and benchmarks use it as root model and
sub-LLM. See :mod:`rlmq.scripted.server`.
"""
