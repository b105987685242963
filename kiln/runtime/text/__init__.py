"""Text in and out: the GGUF's tokenizer, chat templates, incremental detokenization."""
