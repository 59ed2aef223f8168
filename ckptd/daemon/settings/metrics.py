"""``[metrics]``: the optional Prometheus endpoint's address."""
from __future__ import annotations

from dataclasses import dataclass

from ckptd.daemon.settings.spec import Flag, parse_metrics_address, setting, show_address


@dataclass(frozen=True)
class MetricsSettings:
    """``[metrics]``: the optional Prometheus endpoint."""
    address: tuple[str, int] | None = setting(
        None, parse=parse_metrics_address, show=show_address, default_doc="off", flags=(Flag("--metrics-address"),),
        doc="Address of the Prometheus endpoint: `\"host:port\"`, `\"[::1]:port\"`, or a bare port (binds "
            "127.0.0.1). Port 0 picks a free port (shown by `ckptd status`). A port in use fails the start.")
