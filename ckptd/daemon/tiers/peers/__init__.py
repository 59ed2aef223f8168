"""Peer copies: the authenticated listener and links, background replication."""
