"""Sampling: a request's parameters, the model's sticky settings, penalties, grammars and the
sampler."""
