"""The per-node daemon: sessions, slots, step coordination, writing, commit, retention, service glue."""
