"""The paged KV cache's bookkeeping: the block pool and manager, hash and radix prefix indexes (lessons 06, 12)."""
