"""MLflow: an experiment per space, a parent run per invocation, a child run per trial."""
