"""The plain values every layer shares: errors, a trial's record, the metric and knob registries."""
