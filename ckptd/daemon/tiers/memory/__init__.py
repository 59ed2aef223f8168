"""The memory tier: held shards in memfds, the tier in front of the file system, its wiring."""
