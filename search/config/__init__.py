"""The run's settings: Hydra composition, the typed settings, and the space as this device runs
it."""
