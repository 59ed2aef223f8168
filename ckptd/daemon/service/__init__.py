"""The daemon as a service: logs, systemd, metrics, the status snapshot."""
