"""Model side: the runner (the only owner of tensors and the paged KV cache), one decoder for
the Llama / Mistral / Qwen2 / Qwen3 families, paged attention, the loader and built-ins."""
