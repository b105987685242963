"""From a typed request to a reply: the chat template and tool plan (chat), the checks, the
sticky settings and the engine requests (admission), text out of tokens (assembler), and the
one reply driver every route writes through (reply)."""
