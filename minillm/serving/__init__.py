"""The OpenAI-compatible server (lesson 09)."""
