"""Fake edges for engine tests: a model runner that really reads its paged KV cache, a byte
tokenizer and a clock. The scheduler, block pool and engine under test are the real classes."""

from __future__ import annotations

import asyncio
import time
from hashlib import blake2b

from model_worker.sched.batch import SchedulerOutput


class FakeKVRunner:
    """Writes each computed token id into a fake paged KV cache at its slot, and 'samples' the
    next token as a hash of the whole context read back through the block table. A wrong block
    table, a bad prefix-cache hit or a lost block changes the tokens, so tests comparing outputs
    with a solo run catch it."""

    def __init__(self, num_kv_blocks: int, block_size: int, max_model_len: int = 4096,
                 vocab_size: int = 1000, eos_token_ids: tuple[int, ...] = (), step_delay_s: float = 0.0) -> None:
        self.step_delay_s = step_delay_s
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = None
        self.forward_time_s = self.execute_time_s = 0.0
        self.load_times_s: dict[str, float] = {}
        self.sampled_logprobs: dict[str, tuple[float, list[int], list[float]]] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[int], list[float]]]]] = {}
        self.slots: list[int | None] = [None] * (num_kv_blocks * block_size)
        self.batches: list[SchedulerOutput] = []
        self.forced: dict[tuple[str, int], int] = {}
        # Work done, as the real runner counts its layers: a step's delay ticks it every
        # progress_every_s (None: once, at its end; a step stuck in one call does not tick it).
        self.progress = 0
        self.progress_every_s: float | None = 0.01

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, batch: SchedulerOutput) -> list[int]:
        self.batches.append(batch)
        if self.step_delay_s:  # stands in for a forward pass, so streams can be cut mid-way
            if self.progress_every_s is None:
                time.sleep(self.step_delay_s)
            else:
                end_s = time.monotonic() + self.step_delay_s
                while (left_s := end_s - time.monotonic()) > 0:
                    time.sleep(min(left_s, self.progress_every_s))
                    self.progress += 1
        self.progress += 1
        for seq in batch.sequences:  # every write before any read, as the real runner does
            for offset, token in enumerate(seq.token_ids):
                self.slots[self._slot(seq.block_table, seq.start_position + offset)] = token
        sampled = []
        for seq in batch.sequences:
            if seq.prompt_token_ids is not None:  # each prompt token the likeliest, at -0.25
                last = min(seq.context_len, len(seq.prompt_token_ids) - 1)
                k = seq.sampling_params.prompt_logprobs or 0
                self.prompt_logprobs[seq.request_id] = (seq.start_position + 1, [
                    (-0.25, [(t + i) % self.vocab_size for i in range(k)], [-0.25 - i for i in range(k)])
                    for t in seq.prompt_token_ids[seq.start_position + 1:last + 1]])
            if not seq.sample:
                continue
            context = [self.slots[self._slot(seq.block_table, p)] for p in range(seq.context_len)]
            assert None not in context, "read an unwritten KV slot"
            forced = self.forced.get((seq.request_id, seq.output_index))
            token = forced if forced is not None else next_token(context, self.vocab_size)
            sampled.append(token)
            if seq.sampling_params.logprobs is not None:  # the drawn token the likeliest, then its neighbours
                top = [(token + i) % self.vocab_size for i in range(seq.sampling_params.logprobs)]
                self.sampled_logprobs[seq.request_id] = (-0.5, top, [-0.5 - i for i in range(len(top))])
        return sampled


def next_token(context: list[int], vocab_size: int) -> int:
    digest = blake2b(str(context).encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab_size - 3)


def reference_tokens(prompt: list[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    """What a request alone must produce."""
    context = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = next_token(context, vocab_size)
        out.append(token)
        context.append(token)
    return out


class ByteTokenizer:
    """Token id = one UTF-8 byte (+3); 0 is BOS, 1 is EOS, 2 is PAD. Multi-byte characters span
    several tokens, like byte-level BPE."""

    eos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if i >= 3)
        return data.decode("utf-8", errors="replace")


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


async def stats_once_aborted(engine, attempts: int = 200, interval_s: float = 0.01) -> dict:
    """AsyncLLMEngine stats once an abort has landed and nothing runs or waits (bounded wait:
    the abort is applied by the engine thread between steps)."""
    for _ in range(attempts):
        stats = await engine.stats()
        if stats.requests_finished["abort"] and stats.num_running == 0 and stats.num_waiting == 0:
            break
        await asyncio.sleep(interval_s)
    return stats


class ChatByteTokenizer(ByteTokenizer):
    """ByteTokenizer with a chat template: `<role>content\n` per message, then `<assistant>`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")
