"""How shards are encoded and written: the writer's parameters (``codec``, ``level``, ``chunk_bytes``,
``adaptive``: ``codec_mode = "adaptive"``, chunks the disk would wait for written raw; ``direct_io``).

config.py builds one from the settings; the defaults here are the settings' defaults.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptd.core.codec import DEFAULT_CHUNK_BYTES

CODEC_MODES = ("adaptive", "always")     # codec_mode: adaptive (WriteSettings.adaptive) or every chunk encoded
DIRECT_IO = ("auto", "on", "off")         # direct_io (tiers/fs/write_way.py)


@dataclass
class WriteSettings:
    codec: str = "bplane"
    level: int = 1
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    adaptive: bool = True
    direct_io: str = "auto"       # auto / on / off: shards written around the page cache (tiers/fs/write_way.py)
    # Test setting (documented in README): sleep this long before writing each chunk,
    # so a test can kill the daemon while a step is being written.
    debug_write_delay: float = 0.0
    # Test setting: sleep this long before a commit writes the index (a COMMIT that times out).
    debug_commit_delay: float = 0.0
