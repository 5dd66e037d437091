"""Speculative decoding: proposers (n-gram prompt lookup, a draft model, the hybrid of both),
the speculative configuration, the rejection sampler and the per-step draft budget."""
