"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the verifier."""
