"""transformers integration: the attention patch and the facts read from a model's config."""
