"""Shared by the tests: the Hydra overrides that make a study tiny (a GPT small enough that a
trial takes about a second on a 2-core CPU), the workload mapping of a tiny GPT, and the knobs and
metrics such a study's MLflow runs promise. Objects the tests build (measurements, noise floors,
settings) are in ``factories.py``."""

TRIALS_ONLY = [
    "revalidate.processes=0",
    # no confirmation runs after the study (16 fresh runs): tests/retune/test_retune.py covers them
    "retune.confirm=0",
    # no control runs (3 fresh processes, about 9 s an invocation): test_llm_study_end_to_end in
    # tests/commands/test_e2e.py and tests/study/test_study.py measure the machine's noise
    "noise.budget=0",
]
"""No fresh processes but the trials': an invocation's other runs are the same for every study."""
TINY_ANY_SPACE = [
    "device=cpu",
    "preset=cpu",
    # Eager: a test not about the compiler must not pay a cold compile (20-30 s a trial on two
    # cores, every test with a cache of its own); the compiler's tests search it themselves.
    "space.params.compile.choices=[off]",
    "measure.warmup_s=0.1",
    "measure.window_s=0.05",
    "measure.min_windows=3",
    "measure.max_time_s=1",
    *TRIALS_ONLY,
]
"""The overrides of ``TINY`` that any built-in training or serving space takes: the device, no
compiler, short measurements and no fresh processes but the trials'."""
TINY = [
    "space.workload.vocab_size=256",
    "space.workload.seq_len=32",
    "space.workload.d_model=32",
    "space.workload.n_layers=1",
    "space.workload.n_heads=2",
    "space.params.batch_size.high=8",
    "space.params.micro_batch_size.high=8",
    # torch's own attention kernel: a test not about that knob must not spend a trial on math
    # (tests/execution/test_attention.py and the order's tests cover it).
    "space.params.attention.choices=[default]",
    *TINY_ANY_SPACE,
]
"""A tiny ``llm`` study."""
LENIENT = [
    "stable.excess_cv=10",
    "stable.excess_stalls=1",
    "stable.excess_between_cv=10",
]
"""Stability margins no tiny configuration can exceed: every complete trial is stable."""
TINY_GPT = {
    "_target_": "search.workloads.GPT",
    "vocab_size": 64,
    "seq_len": 16,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
}
"""A workload mapping for tests that build a trial request themselves (a step of a few ms)."""
KNOBS = {
    "batch_size",
    "micro_batch_size",
    "precision",
    "streams",
    "recompute",
    "compile",
    "optimizer",
    "attention",
}
"""The llm space's knobs: the params every trial's MLflow run logs."""
CONTRACT_METRICS = {
    "throughput",
    "throughput_ci_low",
    "throughput_ci_high",
    "throughput_cv",
    "latency_p50_ms",
    "latency_p95_ms",
    "peak_memory_mb",
}
