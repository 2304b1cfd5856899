"""Per-rank training and inference loops. Never imports Ray: it runs wherever a DistributedContext exists."""
