"""Tokenization, chat templates, and incremental detokenization with stop strings."""
