"""Pieces both sides share: names, wire protocol, codec, storage primitives, on-disk schemas, readers."""
