"""Each dialect's request bodies (OpenAI's chat, completions and Responses; Ollama's chat and
generate) read into kiln's typed requests, every 400 naming the field as the client wrote it."""
