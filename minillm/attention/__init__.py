"""Attention: the runner's backends, FlashAttention, paged attention and grouped-query attention (lessons 03, 05, 06)."""
