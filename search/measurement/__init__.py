"""Measuring one configuration: timers, the timing protocol and its statistics, GPU and host
telemetry, energy."""
