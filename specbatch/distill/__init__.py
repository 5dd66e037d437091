"""Distilling a small draft model from a target (``specbatch distill-draft``).

Stages (each resumable, results in a work directory): the target answers a diverse prompt set
(`prompts`, `corpus`), standard-library text is added, the target scores every position (top-K
soft labels over a reduced draft vocabulary, `teacher`), students of the requested shapes are
trained to match them (`train`), and the one with the best expected speedup is written as an
ordinary HF model directory (`student`, `pipeline`).
"""

from specbatch.distill.pipeline import DistillConfig, parse_shape, run

__all__ = ["DistillConfig", "parse_shape", "run"]
