"""The local file-system tier: shard writes, the commit, retention."""
