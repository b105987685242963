"""kiln: a small LLM inference server with its own Triton and CPU kernels.

Everything lives under this one package so that no import name of ours can shadow a
library's: transformers probes for Hugging Face's `kernels` package by that name."""
