"""`selfextend serve`: an OpenAI-compatible server over context-shift caches that reuse what they hold."""
