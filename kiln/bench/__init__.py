"""`kiln bench`: a serving benchmark for any OpenAI-compatible server (kiln, vLLM, llama-server,
Ollama, ...). An HTTP client only: nothing here imports the engine, so it measures every server
the same way, through the same requests.

config (what to run) -> prompts (what each request asks) -> client (one request, timed) ->
runner (levels of concurrency) -> results (per request and per level) -> record (the JSON),
report (the tables), chart (the PNG); cli is the subcommand.
"""
