"""Speculative decoding: the rules and drafts, and their place in the engine (lesson 08)."""
