"""The Optuna study: samplers, storage, the driver, guards, the trial store, liveness,
re-validation."""
