"""Where shards go: the tier contract and the file-system, memory, peer and bucket tiers."""
