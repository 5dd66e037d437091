"""Speculative decoding, in four rooms:

* ``proposers/``: who drafts (n-gram prompt lookup, a draft model or a draft head through one
  drafting loop, their hybrid), each declaring what it is made of;
* ``verification/``: which drafts survive (chain and tree rejection sampling, exact);
* ``control/``: how many drafts each sequence gets and which way (the goodput controller, the
  step-time and acceptance models it learns);
* the top level: the configuration (``config``), a step's plan (``plan``), the engine's one
  handle (``speculator``) and what builds it (``factory``).
"""
