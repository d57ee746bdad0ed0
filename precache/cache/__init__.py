"""Cache storage, row plans and the attention over shared caches."""
