"""Natural-language chat prompts for checking a real model: parity tests and dtype agreement.

Twenty conversations of varied lengths (a one-line question to a few paragraphs of context),
rendered with the model's own chat template. SmolLM2's template adds the same system prompt to
each, so prompts share a prefix and exercise the prefix cache too.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = (
    "Continuous batching lets a serving engine decide its batch again before every decode step. "
    "Finished sequences leave at once and waiting ones join at the next step, so a short request "
    "never waits for a long one. The engine keeps each sequence's attention keys and values in a "
    "paged cache of fixed-size blocks, which it can share between requests with the same prefix. "
)

CHAT_PROMPTS: tuple[tuple[dict[str, str], ...], ...] = tuple(
    tuple({"role": role, "content": content} for role, content in conversation) for conversation in (
        (("user", "What is the capital of France?"),),
        (("user", "Name three primary colors."),),
        (("user", "How many days are there in a leap year?"),),
        (("user", "Write a haiku about the ocean."),),
        (("user", "Explain in one sentence what a CPU does."),),
        (("user", "What is the boiling point of water at sea level in Celsius?"),),
        (("user", "Give me a short tip for learning a new language."),),
        (("user", "Translate 'good morning' into Spanish."),),
        (("user", "What does a bee make?"),),
        (("user", "Summarize this in one sentence: " + _CONTEXT),),
        (("user", "Read this and answer the question at the end. " + _CONTEXT
          + "Question: why does a short request not wait for a long one?"),),
        (("user", "List two advantages of exercising every day."),),
        (("user", "Who wrote Romeo and Juliet?"),),
        (("user", "What is 12 times 12?"),),
        (("system", "You answer like a pirate."), ("user", "Where is the treasure?")),
        (("user", "What is photosynthesis?"), ("assistant", "Photosynthesis is how plants make food from light."),
         ("user", "And what gas do they release?")),
        (("user", "Describe a cat to someone who has never seen one, in two sentences."),),
        (("user", "Here are some notes: " + _CONTEXT * 2 + "Turn them into three bullet points."),),
        (("user", "Why is the sky blue? Keep it short."),),
        (("user", "Suggest a name for a friendly robot."),),
    )
)


def render(tokenizer: Any, conversation: tuple[dict[str, str], ...]) -> list[int]:
    """Token ids of a conversation through the tokenizer's own chat template, ready for a reply."""
    text = tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
