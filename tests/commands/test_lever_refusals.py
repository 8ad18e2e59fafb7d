"""The GPU levers asked of a CPU (fp8 precisions, Liger's kernels): one line on stderr, exit code 2,
nothing written to runs_dir. A searched choice the device cannot run is refused on a CPU, as a
fixed one is (a CPU run of a space written for a GPU says what to leave out)."""

from __future__ import annotations

import pytest

from search.commands.cli import main

FP8_NEEDS = "needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer)"
LIGER_NEEDS = "liger's kernels are Triton kernels, which need a CUDA device"
REFUSED = {
    "a searched fp8 precision": (
        ["+space=llm", "device=cpu", "space.params.precision.choices=[bf16,fp8-rowwise]"],
        f"params.precision choice fp8-rowwise cannot run on cpu: fp8-rowwise {FP8_NEEDS}; "
        "leave it out (space.params.precision.choices=[bf16])",
    ),
    "both fp8 precisions on llama": (
        [
            "+space=llama",
            "device=cpu",
            "space.params.precision.choices=[fp32,bf16,fp8-tensorwise,fp8-rowwise]",
        ],
        "params.precision choice fp8-tensorwise cannot run on cpu",
    ),
    "fp8 as the only precision": (
        ["+space=llm", "device=cpu", "space.params.precision.choices=[fp8-tensorwise]"],
        f"params.precision=fp8-tensorwise cannot run on cpu: fp8-tensorwise {FP8_NEEDS}",
    ),
    "liger searched on llama": (
        ["+space=llama", "device=cpu", "space.params.kernels.choices=[torch,liger]"],
        f"params.kernels choice liger cannot run on cpu: {LIGER_NEEDS}; "
        "leave it out (space.params.kernels.choices=[torch])",
    ),
    # GPT has no use_kernels either, but on a CPU the device's refusal comes first
    # (tests/execution/test_kernels.py checks the workload's where the device runs liger).
    "liger searched on the GPT": (
        [
            "+space=llm",
            "device=cpu",
            "+space.params.kernels={type:categorical,choices:[torch,liger]}",
        ],
        f"params.kernels choice liger cannot run on cpu: {LIGER_NEEDS}",
    ),
    "fp8 on the serving space": (
        ["+space=llm_serve", "device=cpu", "space.params.precision.choices=[fp32,fp8-rowwise]"],
        f"params.precision choice fp8-rowwise cannot run on cpu: fp8-rowwise {FP8_NEEDS}",
    ),
}


@pytest.mark.parametrize("argv, expected", REFUSED.values(), ids=REFUSED.keys())
def test_a_gpu_lever_on_a_cpu_exits_2_with_one_line(argv, expected, tmp_path, capsys):
    before = sorted(tmp_path.rglob("*"))
    assert main([*argv, f"runs_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("search: error: "), err
    assert expected in err
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"
