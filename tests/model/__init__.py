"""Tests of the model stage and the loader (GGUF, Hugging Face folders, tokenizer, chat templates)."""
