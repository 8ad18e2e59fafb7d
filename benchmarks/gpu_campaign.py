"""Measure a GPU in one short window: the campaign of docs/operations/gpu.md, step by step.

    python benchmarks/gpu_campaign.py --out benchmarks/results [--budget-s 600] [--steps a,b]

GPU time comes in short windows (about 15 minutes, the machine's start included), so the
campaign runs its steps in the order given (``--steps``), each under a time cap, and stops at its
budget with what it has recorded so far. Each step that ends writes one JSON record to
``--out`` (``<date>-<HHMM>-<device>-<step>.json``: the device, the versions, the command, its wall
time and exit code, the figures it read with their intervals, and the tail of its output). A step
already recorded for this device, in ``--out`` or in ``benchmarks/results``, is skipped, so a later
window takes up what is not yet recorded (``--again`` measures them anew). The steps, in order:

- ``peaks``: the device and its measured peaks (a bf16 matrix product, a device-to-device copy);
- ``fidelity_errors``: ``benchmarks/fidelity_errors.py``, how far bf16, fp16, each fp8 recipe,
  Liger's kernels and the fused optimizer move one step from the fp32 step on a wide Llama, over
  two seeds, against each tolerance;
- ``llm``: the default ``python -m search +space=llm``, whole (``--cap-study-s`` caps its search
  where a device call is shorter than the run);
- ``llama``: ``+space=llama``, capped (``study.timeout_s``);
- ``llama_default``: the whole default ``+space=llama`` run (every default, as a user types it),
  in a study of its own (``llama_default-cuda``); ``llama_default_versus`` sets its
  recommendation beside the first guess, eager and compiled;
- ``llm_versus``, ``llama_versus``: ``benchmarks/versus_baseline.py``, the study's recommendation
  against the expert's hand baseline, eager and compiled, side by side in fresh processes (both
  ratios); ``llama_versus_eager``: the eager baseline alone, where a window has too little left;
- ``pytest_gpu``: ``python -m pytest -m gpu``;
- ``llm_serve``: a short serving study;
- ``retune``: a re-tune of ``llm`` after a model change (one layer fewer), with its verdict;
- ``llama_levers``: a short ``llama`` study of its own (``llama_levers-cuda``) at the H100's
  wall (batch 32, micro-batch 8) over the eager levers: the optimizer's implementation
  (``foreach``, ``fused``) and Liger's fused kernels (``torch``, ``liger``), each tried once at
  the best so far after the first guess; its trial lines say what each came to;
  ``llama_levers_versus`` compares its recommendation with the first guess, eager and compiled;
- ``llama_fp8``: the same wall, compiled (``default``), over fp8 training (``fp8-tensorwise``,
  ``fp8-rowwise`` against ``bf16``): torchao's casts fuse only compiled (eager, fp8-tensorwise
  ran at half bf16's speed on an H100).
- ``hf_qwen``: the whole default ``+space=hf`` run on a transformers model of about 0.5B
  parameters built by config (Qwen2.5-0.5B's shape, nothing fetched); ``hf_qwen_versus`` sets
  its recommendation beside the first guess, eager and compiled;
- ``llm_attention``: a short ``llm`` study of its own (``llm_attention-cuda``) at the default
  run's H100 recommendation (batch 64, micro-batch 64, bf16, compiled, fused AdamW) over the
  kernel of ``scaled_dot_product_attention`` (torch's pick, flash, memory-efficient, cuDNN, math),
  each tried once at the best so far; ``llm_attention_versus`` compares its recommendation with
  the first guess at that batch, eager and compiled.

docs/operations/gpu.md is generated from these records (docs/gen_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results"
TAIL_CHARS = 6000
"""How much of a step's output its record keeps."""


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: float
    """Longest the step may run; it gets less where less of the budget is left."""
    argv: Callable[[Path], list[str]] | None
    """The command, given the runs folder; None: measured in this process (``peaks``)."""
    needs: str | None = None
    """A step whose study this one reads; skipped while that study has no recommendation."""
    study: str | None = None
    """The study folder (under the runs folder) whose best.yaml holds the step's figures."""


def _search(*args: str) -> Callable[[Path], list[str]]:
    return lambda runs: [sys.executable, "-m", "search", *args, f"runs_dir={runs}"]


def _versus(
    space: str, study: str, *overrides: str, report: str = "", flags: tuple[str, ...] = ()
) -> Callable[[Path], list[str]]:
    """versus_baseline.py on ``study``'s recommendation; its report is ``<report>.json`` (the
    step's name, which ``read_figures`` reads), by default ``<study>_versus.json``."""
    report = report or f"{study.removesuffix('-cuda')}_versus"

    def argv(runs: Path) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "benchmarks" / "versus_baseline.py"),
            "--tuned",
            str(runs / study / "best.yaml"),
            "--processes",
            "2",
            *flags,
            "--json",
            str(runs / f"{report}.json"),
            f"+space={space}",
            *overrides,
            f"runs_dir={runs}",
        ]

    return argv


SHORT_ENDING = ("revalidate.max_candidates=2", "retune.confirm=4")
"""A capped study re-validates its two best candidates and confirms its recommendation."""
ONE_WINDOW = ("revalidate.max_candidates=1", "retune.confirm=0")
"""A study that must end, with its comparison, within one window: one candidate re-validated."""

AT_THE_WALL = (
    "+space=llama",
    # the H100's wall (batch 32, micro-batch 8 fit; 16 did not), so that a window's budget goes
    # to the levers, each tried once by the expert's order after the first guess
    "~space.params.batch_size",
    "+space.params.batch_size=32",
    "~space.params.micro_batch_size",
    "+space.params.micro_batch_size=8",
    "space.params.streams.high=1",
    "space.memory_grows_with=[]",
    "space.params.recompute.choices=[none]",
)
LEVERS = (
    "study.name=llama_levers-cuda",
    "space.params.precision.choices=[bf16]",
    "space.params.optimizer.choices=[foreach,fused]",
    "space.params.kernels.choices=[torch,liger]",
    "space.params.compile.choices=[off]",
)
"""The eager levers: fp8 is ``FP8``'s, since eager it lost (0.49x)."""
FP8 = (
    "study.name=llama_fp8-cuda",
    "space.params.precision.choices=[bf16,fp8-tensorwise,fp8-rowwise]",
    "space.params.optimizer.choices=[fused]",
    "space.params.kernels.choices=[torch]",
    "space.params.compile.choices=[default]",
)

AT_LLM_BEST = (
    "+space=llm",
    # the default llm run's recommendation on an H100 (batch 64, micro-batch 64, bf16, compiled,
    # fused AdamW), so that a window's budget goes to the kernels, each tried once at the best
    "~space.params.batch_size",
    "+space.params.batch_size=64",
    "~space.params.micro_batch_size",
    "+space.params.micro_batch_size=64",
    "space.params.streams.high=1",
    "space.memory_grows_with=[]",
    "space.params.recompute.type=categorical",
    "+space.params.recompute.choices=[false]",
    "space.params.precision.choices=[bf16]",
    "space.params.compile.choices=[default]",
    "space.params.optimizer.choices=[fused]",
)
ATTENTION = (
    "study.name=llm_attention-cuda",
    "space.params.attention.choices=[default,flash,efficient,cudnn,math]",
)
"""The attention kernels: the CUDA presets leave torch to pick one until each is measured."""

QWEN_HALF_B = (
    "model=qwen2",
    # Qwen2.5-0.5B's shape, by config (nothing fetched): 24 layers, width 896, 14 heads, 2
    # key-value heads, feed-forward 4,864, vocabulary 151,936; about 0.5B parameters
    "space.workload.layers=24",
    "space.workload.width=896",
    "space.workload.heads=14",
    "space.workload.kv_heads=2",
    "space.workload.intermediate_size=4864",
    "space.workload.vocab_size=151936",
    "+space.workload.settings.tie_word_embeddings=true",
)
"""A transformers model of about 0.5B parameters built by config (``+space=hf``)."""


def _fidelity_errors(runs: Path) -> list[str]:
    script = ROOT / "benchmarks" / "fidelity_errors.py"
    return [
        sys.executable,
        str(script),
        "--seeds",
        "2",
        "--json",
        str(runs / "fidelity_errors.json"),
    ]


STEPS = (
    Step("peaks", 60, None),
    # the errors the fp8 and fused-kernel tolerances bound, measured (first: it needs no study)
    Step("fidelity_errors", 180, _fidelity_errors),
    Step("llm", 600, _search("+space=llm"), study="llm-cuda"),
    # long enough for the order to reach the levers (compile, optimizer, fused kernels: the
    # eighth trial, at 45-65 s a trial), ending within one device call
    Step(
        "llama",
        595,
        _search("+space=llama", "study.timeout_s=380", *ONE_WINDOW),
        study="llama-cuda",
    ),
    # three configurations side by side, the compiled baseline's first run compiling cold
    Step("llm_versus", 300, _versus("llm", "llm-cuda"), needs="llm"),
    Step("llama_versus", 420, _versus("llama", "llama-cuda"), needs="llama"),
    # the eager first guess alone, where a window has too little left for the compiled one
    Step(
        "llama_versus_eager",
        240,
        _versus("llama", "llama-cuda", report="llama_versus_eager", flags=("--no-compiled",)),
        needs="llama",
    ),
    # the whole default llama run, every default (no cap of its own), in a study of its own, then
    # set beside the first guess eager and compiled: issue "every lever within ten minutes"
    Step(
        "llama_default",
        600,
        _search("+space=llama", "study.name=llama_default-cuda"),
        study="llama_default-cuda",
    ),
    Step(
        "llama_default_versus", 420, _versus("llama", "llama_default-cuda"), needs="llama_default"
    ),
    Step("pytest_gpu", 240, lambda runs: [sys.executable, "-m", "pytest", "-q", "-m", "gpu"]),
    Step(
        "llm_serve",
        240,
        _search("+space=llm_serve", "study.timeout_s=90", *SHORT_ENDING),
        study="llm_serve-cuda",
    ),
    Step(
        "retune",
        300,
        _search(
            "retune",
            "+space=llm",
            "space.workload.n_layers=11",
            "retune.n_trials=2",
            "retune.remeasure=1",
            "retune.processes=4",
        ),
        needs="llm",
    ),
    # a transformers model of about 0.5B parameters by config, its whole default run, then
    # beside its expert's first guess, eager and compiled
    Step("hf_qwen", 600, _search("+space=hf", *QWEN_HALF_B), study="hf-qwen2-cuda"),
    Step(
        "hf_qwen_versus",
        420,
        _versus("hf", "hf-qwen2-cuda", *QWEN_HALF_B, report="hf_qwen_versus"),
        needs="hf_qwen",
    ),
    Step(
        "llama_levers",
        330,
        _search(*AT_THE_WALL, *LEVERS, "study.timeout_s=200", *ONE_WINDOW),
        study="llama_levers-cuda",
    ),
    # the levers' recommendation against the expert's first guess at that wall, eager and compiled
    Step(
        "llama_levers_versus",
        420,
        _versus(
            "llama",
            "llama_levers-cuda",
            "~space.params.micro_batch_size",
            "+space.params.micro_batch_size=8",
            "space.memory_grows_with=[batch_size]",
        ),
        needs="llama_levers",
    ),
    Step(
        "llama_fp8",
        420,
        _search(*AT_THE_WALL, *FP8, "study.timeout_s=270", *ONE_WINDOW),
        study="llama_fp8-cuda",
    ),
    Step(
        "llm_attention",
        300,
        _search(*AT_LLM_BEST, *ATTENTION, "study.timeout_s=180", *ONE_WINDOW),
        study="llm_attention-cuda",
    ),
    # the kernel found against the first guess at the same batch, eager and compiled
    Step(
        "llm_attention_versus",
        300,
        _versus("llm", "llm_attention-cuda", *AT_LLM_BEST[1:5], "space.memory_grows_with=[]"),
        needs="llm_attention",
    ),
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RECORDS, help="where the records go")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/gpu-campaign"))
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop starting steps then")
    parser.add_argument("--steps", help="comma-separated step names (default: every step)")
    parser.add_argument("--again", action="store_true", help="measure recorded steps again")
    parser.add_argument(
        "--cap-study-s",
        type=float,
        help="cap each study step's search at this many seconds (study.timeout_s), re-validating "
        "two candidates: a default run takes longer than one device call allows",
    )
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:  # the child process that alone touches the GPU (``probe``)
        print(json.dumps({"device": device_facts(), "peaks": measure_peaks()}))
        return 0
    names = [s.name for s in STEPS]
    chosen = args.steps.split(",") if args.steps else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        print(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(names)}")
        return 2
    started = time.monotonic()
    device, peaks = probe()
    print(f"campaign on {device['name']}: steps {', '.join(chosen)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for step in sorted((s for s in STEPS if s.name in chosen), key=lambda s: chosen.index(s.name)):
        left_s = args.budget_s - (time.monotonic() - started)
        skip = _why_skip(step, device, args, left_s)
        if skip:
            print(f"[{step.name}] skipped: {skip}", flush=True)
            continue
        step = capped(step, args.cap_study_s)
        record = run_step(step, device, peaks, args.runs_dir, min(step.cap_s, left_s))
        # the minute in the name keeps every window's record of a step, several a day
        stamp = time.strftime("%Y-%m-%d-%H%M")
        path = args.out / f"{stamp}-{_slug(device['name'])}-{step.name}.json"
        path.write_text(scrub(json.dumps(record, indent=2, default=str), args.runs_dir))
        print(f"[{step.name}] rc {record['rc']} in {record['wall_s']:.0f} s -> {path}", flush=True)
    return 0


def capped(step: Step, study_s: float | None) -> Step:
    """``step`` with its study's search capped at ``study_s`` (its own cap replaced), ending as a
    capped study does (``SHORT_ENDING``); any other step as it is."""
    if study_s is None or step.study is None or step.argv is None:
        return step
    own = step.argv

    def argv(runs: Path) -> list[str]:
        kept = [a for a in own(runs) if not a.startswith("study.timeout_s=")]
        ending = [a for a in SHORT_ENDING if a not in kept]
        return [*kept, f"study.timeout_s={study_s:.0f}", *ending]

    return dataclasses.replace(step, argv=argv)


def _why_skip(step: Step, device: dict[str, Any], args: argparse.Namespace, left_s: float):
    if left_s < 30:
        return f"{left_s:.0f} s of the budget left"
    pattern = f"*-{_slug(device['name'])}-{step.name}.json"
    if not args.again and any(any(d.glob(pattern)) for d in (args.out, RECORDS)):
        return "recorded already for this device (--again measures it anew)"
    if step.needs:
        needed = next(s for s in STEPS if s.name == step.needs)
        if not (args.runs_dir / str(needed.study) / "best.yaml").exists():
            return f"needs a recommendation of step {step.needs} in {args.runs_dir}"
    return None


def probe() -> tuple[dict[str, Any], dict[str, Any]]:
    """The device's facts and peaks, read in a child process: this one never touches the GPU,
    so every step has the whole device (a process that has used CUDA keeps its context and its
    allocator's cache, 5 GB on an H100 after the peaks)."""
    done = subprocess.run(
        [sys.executable, __file__, "--probe"], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["device"], found["peaks"]


def run_step(
    step: Step, device: dict[str, Any], peaks: dict[str, Any], runs: Path, cap_s: float
) -> dict[str, Any]:
    """Run one step under ``cap_s`` and read its figures."""
    began = time.monotonic()
    record: dict[str, Any] = {"step": step.name, "device": device, "cap_s": round(cap_s)}
    if step.argv is None:
        record.update(rc=0, command="(a child process of the campaign)", figures=peaks)
    else:
        command = step.argv(runs)
        record["command"] = " ".join(command)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cap_s
            )
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = 124, _text(e.stdout) + _text(e.stderr)
        print(output[-2000:], flush=True)
        record.update(rc=rc, output_tail=output[-TAIL_CHARS:])
        record["figures"] = read_figures(step, runs, output)
    record["wall_s"] = time.monotonic() - began
    record["ended"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return record


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def read_figures(step: Step, runs: Path, output: str) -> dict[str, Any]:
    """What a step's files and output say: a study's recommendation and time line, a
    comparison's report, a test run's counts, a re-tune's verdict."""
    figures: dict[str, Any] = {}
    if step.study:
        best = runs / step.study / "best.yaml"
        if best.exists():
            figures["best"] = yaml.safe_load(best.read_text())
    if "_versus" in step.name or step.name == "fidelity_errors":
        report = runs / f"{step.name}.json"
        if report.exists():
            figures["report"] = json.loads(report.read_text())
    for key, pattern in (
        ("time_line", r"^time: .*$"),
        ("tests", r"^\d+ passed.*$|^.*\d+ failed.*$"),
        ("verdict", r"^retune: .*$"),
        ("trial_lines", r"^\[\d+/\d+\] .*$"),
    ):
        found = re.findall(pattern, output, flags=re.MULTILINE)
        if found:
            figures[key] = found if key == "trial_lines" else found[-1]
    return figures


# -- the device and its peaks ------------------------------------------------------------------


def device_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "host_cores": os.cpu_count(),
    }
    if not torch.cuda.is_available():
        return {**facts, "name": "cpu"}
    props = torch.cuda.get_device_properties(0)
    facts.update(
        name=props.name,
        memory_gb=props.total_memory / 1e9,
        capability=f"{props.major}.{props.minor}",
    )
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        facts["power_limit_w"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        facts["other_processes"] = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception as e:  # NVML missing or not supported: the facts say so
        facts["nvml"] = f"unavailable: {e}"
    return facts


def measure_peaks(repeats: int = 5) -> dict[str, Any]:
    """A bf16 8192^3 matrix product and a 2 GiB device-to-device copy, each timed ``repeats``
    times with CUDA events after a warm-up: mean with a 95% t-interval."""
    import torch
    from scipy import stats

    if not torch.cuda.is_available():
        return {}

    def timed(run: Callable[[], Any], inner: int) -> list[float]:
        for _ in range(3):
            run()
        times_s = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                run()
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3 / inner)
        return times_s

    n = 8192
    left, right = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul = [2 * n**3 / t / 1e12 for t in timed(lambda: left @ right, 20)]
    source = torch.empty(2**30, device="cuda", dtype=torch.int16)  # 2 GiB
    target = torch.empty_like(source)
    copy = [2 * source.numel() * 2 / t / 1e9 for t in timed(lambda: target.copy_(source), 10)]

    def interval(values: list[float]) -> dict[str, float]:
        mean = statistics.fmean(values)
        low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
        return {"mean": mean, "ci_low": float(low), "ci_high": float(high), "n": len(values)}

    return {
        "matmul_bf16_tflops": interval(matmul),
        "copy_read_write_gb_s": interval(copy),
    }


def scrub(text: str, runs: Path) -> str:
    """``text`` with this machine's paths made the project's: the runs folder as ``runs``, the
    checkout as ``.``, the interpreter as ``python``, installed packages as ``site-packages``."""
    text = text.replace(str(runs.resolve()), "runs").replace(str(runs), "runs")
    text = text.replace(sys.executable, "python").replace(str(ROOT) + "/", "")
    return re.sub(r"/[^\s\"']*/site-packages/", "site-packages/", text)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
