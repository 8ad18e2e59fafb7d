"""The ``attention`` knob: the step runs the kernel it names, eager, recomputed and compiled (a
graph compiled under one kernel is not taken from the compiler's cache for another), computes the
same as torch's own pick, serves the same tokens, is refused in one line where a CPU has no such
kernel, and, on a GPU, runs each of CUDA's kernels."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.utils import clear_caches
from torch.profiler import profile

from search.config.prepare import load_space
from search.core.errors import ConfigError
from search.core.records import config_name
from search.execution import attention as attention_module
from search.execution import train_step as train_step_module
from search.execution.attention import (
    ATTENTION_KERNELS,
    attention_kernel,
    attention_unsupported,
)
from search.execution.compiling import use_compile_cache
from search.execution.fidelity import check_fidelity
from search.execution.knobs import (
    KnobError,
    Knobs,
    attention_precision_unsupported,
    refuse_unsupported,
)
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.workloads import GPT, GPTServe

CPU = torch.device("cpu")
TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def attention_ops(step: TrainStep) -> set[str]:
    """The attention operators one call of ``step`` runs (the math kernel's are matrix
    products)."""
    with profile() as prof:
        step()
    return {e.key for e in prof.key_averages() if "attention" in e.key or e.key == "aten::bmm"}


def test_a_cpu_has_no_efficient_or_cudnn_kernel_and_says_so_in_one_line():
    for kernel in ("efficient", "cudnn"):
        reason = attention_unsupported(kernel, CPU)
        assert reason and "\n" not in reason and "CUDA" in reason
        with pytest.raises(KnobError, match=f"attention='{kernel}' cannot run on cpu"):
            TrainStep(GPT(**TINY), Knobs(batch_size=2, attention=kernel), CPU)
    for kernel in ("default", "math", "flash"):
        assert attention_unsupported(kernel, CPU) is None
    with pytest.raises(KnobError, match="attention"):
        Knobs(batch_size=2, attention="sdpa")


def test_cuda_flash_and_cudnn_with_fp32_inputs_are_infeasible_not_a_fault():
    # torch would fail every call ("No available kernel"), a fault counted against the study;
    # refused as the step starts, the trial is infeasible (one line, not counted)
    gpu = torch.device("cuda")  # only named: nothing here runs on it
    for kernel in ("flash", "cudnn"):
        for precision in ("fp32", "tf32"):
            reason = attention_precision_unsupported(kernel, precision, gpu)
            assert reason == (
                f"CUDA's {kernel} kernel takes fp16 and bf16 inputs only, and a step in "
                f"{precision} runs attention in fp32"
            )
        with pytest.raises(KnobError, match=f"attention='{kernel}' with precision='fp32' cannot"):
            refuse_unsupported(Knobs(batch_size=2, attention=kernel), gpu)
        for precision in ("bf16", "fp16", "fp8-tensorwise"):
            assert attention_precision_unsupported(kernel, precision, gpu) is None
        assert attention_precision_unsupported(kernel, "fp32", CPU) is None
    for kernel in ("default", "math", "efficient"):
        assert attention_precision_unsupported(kernel, "fp32", gpu) is None
        refuse_unsupported(Knobs(batch_size=2, attention=kernel), gpu)


def test_a_cuda_space_whose_every_configuration_pairs_them_is_refused_before_its_study():
    raw = {
        "name": "flash32",
        "workload": {"_target_": "search.workloads.GPT", **TINY},
        "params": {
            "batch_size": {"type": "int", "low": 2, "high": 4, "pow2": True},
            "precision": {"type": "categorical", "choices": ["fp32"]},
            "attention": {"type": "categorical", "choices": ["flash", "cudnn"]},
        },
        "objectives": {"throughput": "maximize"},
    }
    gpu = torch.device("cuda")  # only named: the checks read its type
    with pytest.raises(ConfigError, match="no configuration can run, e.g. attention='flash' with"):
        load_space(raw, gpu)
    raw["params"]["attention"]["choices"] = ["flash", "efficient"]  # efficient takes fp32
    assert load_space(raw, gpu)[0].params["attention"].values() == ["flash", "efficient"]


def test_on_cuda_the_half_only_kernels_are_not_proposed_at_fp32(monkeypatch):
    """At an fp32 best the order tried CUDA's flash and cuDNN kernels, each refused by its own
    process after it started and counted as a trial; the space now leaves them out there."""
    raw = {
        "name": "t",
        "workload": {"_target_": "search.workloads.GPT", **TINY},
        "params": {
            "batch_size": {"type": "int", "low": 2, "high": 4, "pow2": True},
            "precision": {"type": "categorical", "choices": ["fp32", "bf16"]},
            "attention": {"type": "categorical", "choices": ["math", "flash", "cudnn"]},
        },
        "objectives": {"throughput": "maximize"},
    }
    gpu = torch.device("cuda")  # only named: the checks read its type, and bf16 its capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    space, notes = load_space(raw, gpu)
    pairs = {(c["attention"], c["precision"]) for c in space.feasible_configs() or []}
    assert pairs == {("math", "fp32"), ("math", "bf16"), ("flash", "bf16"), ("cudnn", "bf16")}
    assert any(n.startswith("attention=flash/cudnn at precision bf16 only") for n in notes), notes
    raw["params"]["attention"]["choices"] = ["math", "flash"]  # a CPU's flash kernel takes fp32
    assert len(load_space(raw, CPU)[0].feasible_configs() or []) == 2 * 2 * 2


def test_the_choices_and_the_label():
    assert ATTENTION_KERNELS == ("default", "math", "flash", "efficient", "cudnn")
    assert config_name({"batch_size": 8, "attention": "default"}) == "bs8"
    assert config_name({"batch_size": 8, "attention": "math"}) == "bs8·attn:math"


@pytest.mark.parametrize("recompute", ["none", "all"])
def test_the_step_runs_the_kernel_it_names(recompute):
    for kernel, runs_flash in (("default", True), ("flash", True), ("math", False)):
        knobs = Knobs(batch_size=4, attention=kernel, recompute=recompute)
        with TrainStep(GPT(**TINY), knobs, CPU) as step:
            ops = attention_ops(step)
        assert (CPU_FLASH in ops) is runs_flash, (kernel, ops)
        assert ("aten::bmm" in ops) is not runs_flash, (kernel, ops)


def test_a_recomputed_forward_runs_the_kernel_its_first_pass_ran(monkeypatch):
    # the kernel set only around the forward: backward's recomputed forward picks flash, whose
    # saved tensors differ from the math pass's, and torch's checkpoint refuses the step; set
    # around the whole step (forward and backward), it runs
    knobs = Knobs(batch_size=4, recompute="all", attention="math")
    with TrainStep(GPT(**TINY), knobs, CPU) as step:
        step()
    monkeypatch.setattr(train_step_module, "attention_kernel", lambda *kernel: nullcontext())
    workload = GPT(**TINY)
    loss = workload.loss

    def under_math_only(model, batch):
        with attention_kernel("math"):
            return loss(model, batch)

    monkeypatch.setattr(workload, "loss", under_math_only)
    with TrainStep(workload, knobs, CPU) as step, pytest.raises(Exception, match="metadata"):
        step()


def test_lanes_share_the_setting_and_leave_torch_own_pick_as_found():
    # the setting is the process's: entered in each lane, the first lane to end restored it under
    # the other, whose recomputed forwards then picked flash, and the last left math set for good
    knobs = Knobs(batch_size=8, micro_batch_size=2, streams=2, recompute="all", attention="math")
    with TrainStep(GPT(**TINY), knobs, CPU) as step:
        for _ in range(5):
            step()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled()


def test_math_computes_the_step_torch_own_pick_computes():
    report = check_fidelity(GPT(**TINY), Knobs(batch_size=4, attention="math"), CPU)
    assert report.ok, report
    assert report.loss_rel_error < 1e-5


def compiled_kernels(kernels: tuple[str, ...], cache: Path) -> dict[str, tuple[bool, int]]:
    """Whether each of ``kernels``' compiled steps runs the CPU's flash kernel, and how many
    kernel files its compile added to the compiler's cache ``cache``, compiled one after the other
    there, as each trial's worker compiles into the device's one cache."""
    compiled = {}
    for kernel in kernels:
        torch._dynamo.reset()  # as a fresh process: only the on-disk cache is shared
        clear_caches()  # the compiled kernels this process loaded
        use_compile_cache(cache)
        files_before = set(cache.rglob("*.so"))
        knobs = Knobs(batch_size=4, attention=kernel, compile="default")
        # one layer: each compile here is a cold one, and their graphs' size is their cost
        with TrainStep(GPT(**{**TINY, "n_layers": 1}), knobs, CPU) as step:
            runs_flash = any("flash" in op for op in attention_ops(step))
            # the graph is one AOTAutograd can keep: a warm compile need not trace it again
            assert not counters["aot_autograd"]["autograd_cache_bypass"], kernel
        compiled[kernel] = (runs_flash, len(set(cache.rglob("*.so")) - files_before))
    torch._dynamo.reset()
    return compiled


def test_a_compiled_step_is_not_handed_another_kernels_graph_from_the_cache(tmp_path, monkeypatch):
    # empty caches of this test's own (restored after it): the first compile fills them
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(variable, os.environ.get(variable, ""))
    compiled = compiled_kernels(("default", "math"), tmp_path / "one")
    assert compiled["default"][0] and not compiled["math"][0], compiled
    # math compiled only the kernels it does not share with default: 8 files against default's 13
    # (in a folder of its own it compiled all its 17)
    default_files, math_files = compiled["default"][1], compiled["math"][1]
    assert 0 < math_files < default_files, compiled
    # the control: without the kernel in the key, the cache hands math the graph compiled above
    # for torch's own pick, which runs flash
    monkeypatch.setattr(attention_module, "_kernel_in_cache_key", lambda kernel: None)
    assert compiled_kernels(("math",), tmp_path / "one")["math"] == (True, 0)


def test_serving_under_math_generates_what_torch_own_pick_generates():
    workload = GPTServe(vocab_size=64, prompt_len=8, gen_len=4, d_model=32, n_layers=2, n_heads=2)
    generated = {}
    for kernel in ("default", "math"):
        with ServeStep(workload, Knobs(batch_size=2, attention=kernel), CPU) as step:
            generated[kernel] = step.generate()
    assert torch.equal(generated["math"].tokens, generated["default"].tokens)
    torch.testing.assert_close(generated["math"].logits, generated["default"].logits)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cuda_refuses_fp32_inputs_to_the_kernels_the_knob_refuses_them_for(kernel):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash and cuDNN attention need compute capability 8.0 or newer")
    # the premise of attention_precision_unsupported, on this torch: fp32 gets no such kernel
    q = torch.randn(2, 128, 2, 64, device="cuda").transpose(1, 2)  # heads split as GPT's are
    with attention_kernel(kernel), pytest.raises(RuntimeError, match="No available kernel"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with attention_kernel(kernel):
        torch.nn.functional.scaled_dot_product_attention(*(q.bfloat16(),) * 3, is_causal=True)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["math", "flash", "efficient", "cudnn"])
def test_each_cuda_kernel_trains_and_computes_the_fp32_step(kernel):
    gpu = torch.device("cuda")
    workload = GPT(vocab_size=512, seq_len=128, d_model=128, n_layers=2, n_heads=2)
    knobs = Knobs(batch_size=4, precision="bf16", attention=kernel)
    report = check_fidelity(workload, knobs, gpu)
    assert report.ok, report
    with TrainStep(workload, knobs, gpu) as step:
        step()
        torch.cuda.synchronize()
