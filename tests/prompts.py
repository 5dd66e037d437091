"""A fixed, diverse prompt set for real-model tests (not the Spec-Bench evaluation prompts)."""

from __future__ import annotations

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "List three primary colors:",
    "The theory of relativity states that",
    "import numpy as np\n\ndef normalize(x):",
    "Translate to French: Good morning, how are you?",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
    "Write a SQL query that selects all users",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Dear hiring manager,\n\nI am writing to apply for",
    "The three laws of thermodynamics are",
    "Summarize: The meeting covered the budget, the hiring plan and the office move.",
]

CHAT = [
    "What is the capital of Japan?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for better sleep.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse.",
    "What is 15% of 80?",
    "Write a Python function that reverses a string.",
    "Name two planets larger than Earth.",
    "Repeat after me: red, green, blue, red, green, blue, red, green, blue.",
    "Correct the grammar: she don't like apples.",
    "What does HTTP stand for?",
    "Suggest a name for a coffee shop.",
    "Convert 5 kilometres to miles.",
    "Describe the colour blue to someone who cannot see.",
    "Write a limerick about a programmer.",
    "Edit this code to add a docstring: def area(r): return 3.14159 * r * r",
]


def prompt_set(tokenizer: object) -> list[str]:
    """32 prompts: the plain ones and the chat ones rendered with the model's chat template."""
    render = tokenizer.apply_chat_template  # type: ignore[attr-defined]
    return PLAIN + [render([{"role": "user", "content": c}]) for c in CHAT]
