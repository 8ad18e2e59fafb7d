"""Running one trial: the generic knobs, serving, fidelity, the isolated worker process."""
