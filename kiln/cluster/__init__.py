"""kiln on Ray Serve: several engine replicas behind one OpenAI endpoint (`kiln serve
--replicas N`).

The whole API layer (the Sanic app, validation, the sticky sampling settings, grammars,
detokenization) stays in one ingress process; only the engine is replaced, by a
`ClusterEngine` (engine.py) that forwards each request to a Ray Serve replica (replica.py),
each its own process with its own LLMEngine and KV cache. The replica is chosen by
`PrefixAwareRouter` (router.py): the one whose prefix cache holds the longest prefix of the
prompt, by the chained block hashes the KV cache keys its blocks with, else the least loaded.
`launch.py` starts (or attaches to) the Ray cluster and deploys the replicas.
"""
