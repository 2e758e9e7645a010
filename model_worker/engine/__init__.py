"""The engine: the step loop (LLMEngine), the loop that runs it fed by messages, in a thread or a
process of its own, and the asynchronous side that streams its outputs."""
