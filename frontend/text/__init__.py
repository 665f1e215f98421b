"""Text <-> tokens: the tokenizer, the incremental detokenizer, token bytes."""
