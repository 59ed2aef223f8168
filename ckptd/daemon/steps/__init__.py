"""Steps in flight: the state machine and the coordinator that drives it."""
