"""Proposers: prompt lookup (``ngram``), drafting networks (``drafting`` runs a ``draft_model``
or a ``head`` through the same chain and tree loops), their composite (``hybrid``), the shipped
draft and head (``shipped``), and the interface they share (``base``)."""
