"""KV cache: context-shift cache layers and prompt-cache files."""
