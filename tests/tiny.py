"""Overrides shared by the end-to-end tests: a GPT small enough that a trial takes about a second on
a 2-core CPU, and the knobs and metrics the MLflow contract promises."""

TINY = [
    "device=cpu", "preset=cpu",
    "space.workload.vocab_size=256", "space.workload.seq_len=32", "space.workload.d_model=32",
    "space.workload.n_layers=1", "space.workload.n_heads=2",
    "space.params.batch_size.high=8", "space.params.micro_batch_size.high=8",
    "measure.warmup_s=0.1", "measure.window_s=0.05", "measure.min_windows=3", "measure.max_time_s=1",
    "revalidate.processes=0",
]
KNOBS = {"batch_size", "micro_batch_size", "precision", "streams", "recompute"}
CONTRACT_METRICS = {"throughput", "throughput_ci_low", "throughput_ci_high", "throughput_cv",
                    "latency_p50_ms", "latency_p95_ms", "peak_memory_mb"}
