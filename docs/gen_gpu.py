"""Writes operations/gpu.md at build time (mkdocs-gen-files) from the GPU campaign's records.

Every GPU figure on that page comes from a JSON record of ``benchmarks/gpu_campaign.py`` in
``benchmarks/results/`` (one per step and run: the device, the versions, the command, its wall
time, the figures with their intervals, the tail of its output). The hand-written prose around
them is ``operations/gpu-template.md``: the records replace its marker line, newest first, one
section per device and day.

Run it alone to print the page: ``python docs/gen_gpu.py``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results"
TEMPLATE = ROOT / "docs" / "operations" / "gpu-template.md"
MARKER = "<!-- the campaign's records go here (docs/gen_gpu.py) -->"
PAGE = "operations/gpu.md"
STEP_ORDER = (
    "peaks",
    "fidelity_errors",
    "llm",
    "llama",
    "llm_versus",
    "llama_versus",
    "llama_versus_eager",
    "llama_default",
    "llama_default_versus",
    "pytest_gpu",
    "llm_serve",
    "retune",
    "hf_qwen",
    "hf_qwen_versus",
    "llama_levers",
    "llama_levers_versus",
    "llama_fp8",
    "llm_attention",
    "llm_attention_versus",
)


def si(value: float) -> str:
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def _interval(figure: dict[str, float], unit: str = "") -> str:
    return (
        f"{figure['mean']:.0f}{unit} [{figure['ci_low']:.0f}, {figure['ci_high']:.0f}] "
        f"(95% CI, {figure['n']} repeats)"
    )


def _peaks(record: dict[str, Any]) -> list[str]:
    figures = record["figures"]
    if not figures:
        return ["- **Peaks**: not measured (no CUDA device)."]
    return [
        f"- **Peaks**, measured: a bf16 8192³ matrix product "
        f"{_interval(figures['matmul_bf16_tflops'], ' TFLOP/s')}; a 2 GiB device-to-device copy "
        f"{_interval(figures['copy_read_write_gb_s'], ' GB/s')} (bytes read and written)."
    ]


def _last_line(record: dict[str, Any], prefix: str) -> str | None:
    lines = [line for line in record.get("output_tail", "").splitlines() if line.startswith(prefix)]
    return lines[-1] if lines else None


def _study(record: dict[str, Any]) -> list[str]:
    figures, out = record["figures"], []
    stopped = " (stopped by the step's cap)" if record["rc"] == 124 else f" (exit {record['rc']})"
    out.append(
        f"- **`{record['step']}` study**: `{_command(record)}`, {record['wall_s']:.0f} s of wall "
        f"time{stopped}."
    )
    best = figures.get("best")
    if best and best.get("recommended"):
        m, unit = best["metrics"], best["throughput_unit"]
        energy = (
            f", {m['energy_per_item_j'] * 1e3:.2f} mJ per {unit.split('/')[0][:-1]}"
            if "energy_per_item_j" in m
            else ""
        )
        out.append(
            f"  Recommended #{best['recommended']['trial']} `{best['recommended']['config']}`: "
            f"{si(m['throughput'])} [{si(m['throughput_ci_low'])}, {si(m['throughput_ci_high'])}] "
            f"{unit} (95% CI, {m.get('n_processes', 1):.0f} fresh processes), peak "
            f"{m['peak_memory_mb'] / 1e3:.1f} GB{energy}."
        )
    noise = _last_line(record, "this machine:")
    if noise:
        out.append(f"  Noise floor: {noise.removeprefix('this machine: ')}.")
    if figures.get("time_line"):
        out.append(f"  Time: {figures['time_line'].removeprefix('time: ')}.")
    if figures.get("trial_lines"):
        lines = [_short(line) for line in figures["trial_lines"]]
        out += ["", "  ```", *(f"  {line}" for line in lines), "  ```", ""]
    return out


_OOM_DETAIL = re.compile(r"(oom: CUDA out of memory\. Tried to allocate [\d.]+ \w+\.)[^|]*")


def _short(line: str) -> str:
    """A trial line with CUDA's out-of-memory advice cut after its first sentence."""
    return _OOM_DETAIL.sub(r"\1 ... ", line)


def _versus(record: dict[str, Any]) -> list[str]:
    report = record["figures"].get("report")
    head = f"- **`{record['step']}`**: `{_command(record)}`, {record['wall_s']:.0f} s."
    if not report:
        return [head + f" No report (exit {record['rc']})."]
    out, unit = [head], report.get("unit", "items/s")
    for name in ("tuned", "baseline", "compiled"):
        f = report.get(name)
        if f is None:
            continue
        line = (
            f"  {ARM_NAMES[name]} `{report['configs'][name]}`: {si(f['throughput'])} "
            f"[{si(f['throughput_ci_low'])}, {si(f['throughput_ci_high'])}] {unit} (95% CI, "
            f"{f['processes']} fresh processes, between-process CV {f['between_process_cv']:.2%}), "
            f"peak {f['peak_memory_mb'] / 1e3:.1f} GB"
        )
        if "energy_per_item_j" in f:
            line += f", {f['energy_per_item_j'] * 1e3:.2f} mJ per {unit.split('/')[0].rstrip('s')}"
        if "mean_power_w" in f:
            line += f" at {f['mean_power_w']:.0f} W"
        if "model_tflops" in f:
            line += (
                f", {f['model_tflops']:.0f} model TFLOP/s ({f['mfu_vs_measured_matmul']:.1%} of "
                f"the {report['matmul_bf16_tflops']:.0f} TFLOP/s bf16 matrix product measured in "
                "the same run)"
            )
        if "compile_time_s" in f:
            line += (
                f"; compiled in {f['compile_time_s']:.0f} s a process (mean) before the timed "
                "windows, not in its throughput"
            )
        out.append(line + ".")
    if report.get("compiled_failure"):
        out.append(f"  The compiled baseline was left out: {_short(report['compiled_failure'])}.")
    r = report["ratio"]
    out.append(
        f"  **Tuned / baseline: {r['tuned_over_baseline']:.3f} [{r['ci_low']:.3f}, "
        f"{r['ci_high']:.3f}]** (95% CI, Welch on the log process means; interleaved)."
    )
    c = report.get("ratio_compiled")
    if c:
        out.append(
            f"  **Tuned / compiled baseline: {c['tuned_over_compiled']:.3f} [{c['ci_low']:.3f}, "
            f"{c['ci_high']:.3f}]** (95% CI, the same way; compile time excluded)."
        )
    return out


ARM_NAMES = {
    "tuned": "Tuned",
    "baseline": "Baseline (the expert's first guess, eager)",
    "compiled": "Compiled baseline (the first guess, `compile: default`)",
}


def _plain(record: dict[str, Any]) -> list[str]:
    figures = record["figures"]
    said = figures.get("tests") or figures.get("verdict") or f"exit {record['rc']}"
    return [f"- **`{record['step']}`**: `{_command(record)}`: {said} ({record['wall_s']:.0f} s)."]


def _command(record: dict[str, Any]) -> str:
    """The command as run, the runs folder and the report's file left out."""
    return re.sub(r" runs_dir=\S+| --json \S+", "", record["command"])


def _fidelity_errors(record: dict[str, Any]) -> list[str]:
    """The largest error each lever showed over the seeds, beside its tolerance: the margin."""
    head = f"- **`{record['step']}`**: `{_command(record)}`, {record['wall_s']:.0f} s."
    report = record["figures"].get("report")
    summaries = (
        report["summary"]
        if report
        else [
            json.loads(line)["summary"]
            for line in record.get("output_tail", "").splitlines()
            if line.startswith('{"summary"')
        ]
    )
    if not summaries:
        return [head + f" No figures (exit {record['rc']})."]
    out = [
        head,
        "",
        "  | configuration | loss, largest relative error | gradient norm, largest | tolerance "
        "(loss, gradient norm) |",
        "  |---|---|---|---|",
    ]
    for row in summaries:
        levers = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("largest", "tolerance"))
        largest = row["largest"]
        loss = largest.get("fidelity_loss_rel_error")
        grad = largest.get("fidelity_grad_norm_rel_error")
        bounds = dict(re.findall(r"(\w+)=([\d.e-]+)", row["tolerance"]))
        tolerance = f"{float(bounds['loss_rel']):.3g}, {float(bounds['grad_norm_rel']):.3g}"
        shown = [f"{x:.2e}" if x is not None else "refused" for x in (loss, grad)]
        out.append(f"  | {levers} | {shown[0]} | {shown[1]} | {tolerance} |")
    return [*out, ""]


RENDER = {
    "peaks": _peaks,
    "fidelity_errors": _fidelity_errors,
    "llm": _study,
    "llama": _study,
    "llama_default": _study,
    "llm_serve": _study,
    "llama_levers": _study,
    "llama_fp8": _study,
    "llm_attention": _study,
    "hf_qwen": _study,
    "llm_versus": _versus,
    "llama_versus": _versus,
    "llama_versus_eager": _versus,
    "llama_default_versus": _versus,
    "llama_levers_versus": _versus,
    "llm_attention_versus": _versus,
    "hf_qwen_versus": _versus,
}


def section(records: list[dict[str, Any]]) -> list[str]:
    device = records[0]["device"]
    day = records[0]["ended"].split()[0]
    out = [
        f"## {device['name']}, {day}",
        "",
        f"Driver {device.get('driver', '?')}, CUDA {device.get('cuda')}, torch {device['torch']}, "
        f"Python {device['python']}, {device.get('memory_gb', 0):.0f} GB, power limit "
        f"{device.get('power_limit_w', 0):.0f} W, {device['host_cores']} host cores; other "
        f"processes on the GPU at the start: {device.get('other_processes', '?')}.",
        "",
    ]
    for window, ended in enumerate(_windows(records)):
        if window or len(ended) < len(records):
            out += ["", f"### Window ending {ended[-1]['ended'].split()[1][:5]} UTC", ""]
        for record in sorted(ended, key=lambda r: STEP_ORDER.index(r["step"])):
            out += RENDER.get(record["step"], _plain)(record)
            if record.get("notes"):
                out.append(f"  *Note:* {record['notes']}")
    return [*out, ""]


def _windows(records: list[dict[str, Any]], gap_s: float = 1800) -> list[list[dict[str, Any]]]:
    """A day's records split where more than ``gap_s`` passed between two: one list per window
    of GPU time, in the order they ran (a window holds the machine for at most 30 minutes)."""
    ordered = sorted(records, key=lambda r: r["ended"])
    windows = [[ordered[0]]]
    for before, record in zip(ordered, ordered[1:], strict=False):
        if _seconds(record["ended"]) - _seconds(before["ended"]) > gap_s:
            windows.append([])
        windows[-1].append(record)
    return windows


def _seconds(ended: str) -> float:
    return datetime.strptime(ended.removesuffix(" UTC"), "%Y-%m-%d %H:%M:%S").timestamp()


def page() -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(RECORDS.glob("*.json")):
        record = json.loads(path.read_text())
        groups[(path.name[:10], record["device"]["name"])].append(record)
    body = [line for key in sorted(groups, reverse=True) for line in section(groups[key])]
    template = TEMPLATE.read_text()
    if MARKER not in template:
        raise SystemExit(f"{TEMPLATE} lacks the marker line {MARKER!r}")
    return template.replace(MARKER, "\n".join(body).rstrip())


if __name__ == "__main__":
    sys.stdout.write(page())
else:
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as f:
        f.write(page())
