"""Prompts that tests and benchmarks send to the demo models, in their
chat template."""

from __future__ import annotations

QUESTIONS = [
    "Tell me about the river.",
    "Who built the mill?",
    "What did the miller say?",
    "Where does the old road go?",
    "Describe the stone bridge.",
    "What grows along the bank?",
    "Who lives by the water?",
    "When does the market open?",
]
PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
THINK = PROMPTS[0] + "<think>\n"
# One row each: greedy, then sampling settings that differ in every field.
MIXED = [
    dict(temperature=0.0),
    dict(temperature=1.0, top_k=5, top_p=1.0, repetition_penalty=1.0, seed=11),
    dict(temperature=0.7, top_k=0, top_p=0.8, repetition_penalty=1.0, seed=12),
    dict(temperature=1.2, top_k=50, top_p=0.9, repetition_penalty=1.5, seed=13),
    dict(temperature=0.9, seed=14),
]
# The prompts (of the above) that the multi-adapter tests run, how many
# tokens they generate, and how many the long rows that run while an
# adapter is reloaded (prompts 0 and 1) do.
ADAPTER_PROMPTS = [PROMPTS[i] for i in (0, 1, 2, 4)]
ADAPTER_TOKENS = 24
ADAPTER_LONG = 120

SYSTEM = "You are a terse guide to the river, the mill and the old stone bridge."


def chatml(turns: list[tuple[str, str]], system: str | None = None) -> str:
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"
