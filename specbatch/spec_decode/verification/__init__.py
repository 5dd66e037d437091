"""Verification: a step's drafts against the target's logits, chains (``chain``) and trees
(``tree``), keeping exactly the target's output distribution."""
