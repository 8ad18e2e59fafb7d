"""Measure how far each lower-precision lever moves one training step from the fp32 step.

The tolerances in ``search/execution/tolerances.py`` for fp8 and fused kernels were derived from
the formats' rounding; this script measures the errors they bound, on a Llama wide enough for
both of torchao's fp8 recipes, over several seeds (each seed: fresh weights and tokens). It prints
one JSON line per configuration and seed, then a summary line per configuration with the largest
error seen and its tolerance, so that a record shows the margin each tolerance leaves.

    python benchmarks/fidelity_errors.py --seeds 3 --json errors.json

Needs a CUDA device; fp8 rows need compute capability 8.9 or newer, liger rows liger-kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search.execution.fidelity import check_fidelity  # noqa: E402
from search.execution.knobs import KnobError, Knobs  # noqa: E402
from search.execution.tolerances import TOLERANCES  # noqa: E402
from search.workloads import Llama  # noqa: E402

# the shape of tests/execution/test_fp8.py: wide enough that both recipes convert some layers
WIDE_LLAMA = dict(
    vocab_size=32000,
    seq_len=256,
    hidden_size=2048,
    n_layers=2,
    n_heads=16,
    n_kv_heads=4,
    intermediate_size=5632,
)
CONFIGURATIONS = (
    dict(precision="bf16"),
    dict(precision="fp16"),
    dict(precision="fp8-tensorwise"),
    dict(precision="fp8-rowwise"),
    dict(precision="bf16", kernels="liger"),
    dict(precision="bf16", optimizer="fused"),
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every row and the summary here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    device = torch.device("cuda")
    rows, summary = [], []
    for levers in CONFIGURATIONS:
        knobs = Knobs(batch_size=4, micro_batch_size=2, **levers)
        errors: dict[str, list[float]] = {}
        for seed in range(args.seeds):
            try:
                report = check_fidelity(Llama(**WIDE_LLAMA), knobs, device, seed=seed)
            except KnobError as refused:
                rows.append({**levers, "seed": seed, "refused": str(refused)})
                print(json.dumps(rows[-1]), flush=True)
                break
            row = {**levers, "seed": seed, "ok": report.ok, "reason": report.reason}
            row.update(report.errors)
            rows.append(row)
            print(json.dumps(row), flush=True)
            for name, value in report.errors.items():
                errors.setdefault(name, []).append(value)
        largest = {name: max(values) for name, values in errors.items()}
        summary.append(
            {**levers, "largest": largest, "tolerance": str(TOLERANCES[knobs.precision])}
        )
        print(json.dumps({"summary": summary[-1]}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
