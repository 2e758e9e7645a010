"""The engine: the step (LLMEngine), the loop that runs it fed by messages (EngineLoop, speaking
protocol.py), the handles that run that loop in a thread or a process of its own (EngineThread,
EngineProcess), and the asynchronous side that streams its outputs (AsyncLLMEngine)."""
