"""Speculative decoding: drafted tokens checked against the model's own choice in the step's one
batched forward (contract.md, "Speculative decoding"). A drafter proposes tokens per request
(ngram.py: prompt lookup); the scheduler gives a drafting row 1 + k tokens; the engine
(LLMEngine._check_drafts) keeps each draft that equals the argmax of the model's raw logits at
its position."""
