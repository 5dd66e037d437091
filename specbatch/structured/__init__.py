"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled for the
model's tokenizer (``grammar``, ``bridge``), and each sequence's matcher and masks
(``constraint``). llguidance does the matching."""
