"""fp8 precisions (torchao's float8 training): refused where they cannot run, in one line; the
layers torchao's size rules pick; and, on a GPU with fp8 tensor cores, a step that trains and
computes the fp32 step. torchao is imported only by the tests that need it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from search.execution.fidelity import check_fidelity
from search.execution.fp8 import FP8_PRECISIONS, convert_fp8, fp8_layers, fp8_unsupported
from search.execution.knobs import AUTOCAST_DTYPES, KnobError, Knobs
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.workloads import GPT, GPTServe, Llama

CPU = torch.device("cpu")
# Wide enough for both of torchao 0.17's recipes: tensorwise takes every projection but the
# key-value ones (512 outputs); rowwise only the MLP's gate and up projections (5632x2048).
WIDE_LLAMA = dict(
    vocab_size=32000,
    seq_len=256,
    hidden_size=2048,
    n_layers=2,
    n_heads=16,
    n_kv_heads=4,
    intermediate_size=5632,
)
NARROW_GPT = dict(vocab_size=4096, seq_len=128, d_model=128, n_layers=2, n_heads=4)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_meta(build):
    """A model built on the meta device: shapes only, no memory, no time."""
    with torch.device("meta"):
        return build()


# -- where fp8 cannot run -----------------------------------------------------------------------


@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_a_cpu_cannot_run_fp8_and_says_so_in_one_line(precision):
    reason = fp8_unsupported(precision, CPU)
    assert reason and "\n" not in reason
    assert "CUDA" in reason and "8.9" in reason


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_other_precisions_are_not_fp8s_to_refuse(precision):
    assert fp8_unsupported(precision, CPU) is None


def test_fp8_runs_the_rest_of_the_step_under_bf16_autocast():
    assert all(AUTOCAST_DTYPES[p] is torch.bfloat16 for p in FP8_PRECISIONS)


@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_a_train_step_refuses_fp8_on_a_cpu_before_building_anything(precision):
    with pytest.raises(KnobError, match=f"precision='{precision}' cannot run on cpu"):
        TrainStep(GPT(**NARROW_GPT), Knobs(batch_size=2, precision=precision), CPU)


@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_serving_refuses_fp8_as_a_training_precision(precision):
    workload = GPTServe(vocab_size=97, prompt_len=12, gen_len=5, d_model=32, n_layers=2, n_heads=4)
    with pytest.raises(KnobError, match="does not apply to serving") as refused:
        ServeStep(workload, Knobs(batch_size=2, precision=precision), CPU)
    assert "\n" not in str(refused.value) and "float8 training" in str(refused.value)


def test_a_precision_that_is_not_fp8_converts_nothing():
    model = nn.Sequential(nn.Linear(32, 32))
    assert convert_fp8(model, "bf16") == 0
    assert type(model[0]) is nn.Linear


# -- the layers torchao's rules pick (torchao needed, no GPU: the model is on the meta device) --


def test_the_layers_each_recipe_picks_on_a_wide_llama():
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    model = on_meta(Llama(**WIDE_LLAMA).build_model)
    tensorwise = fp8_layers(model, "fp8-tensorwise")
    rowwise = fp8_layers(model, "fp8-rowwise")
    parts = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"]
    assert tensorwise == [
        f"model.layers.{i}.{part}" for i in range(2) for part in [*parts, "mlp.down_proj"]
    ]
    assert rowwise == [
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")
    ]
    assert not any("lm_head" in name for name in tensorwise)  # the output layer stays bf16


def test_convert_swaps_exactly_the_picked_layers():
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    model = on_meta(Llama(**WIDE_LLAMA).build_model)
    picked = set(fp8_layers(model, "fp8-rowwise"))
    assert convert_fp8(model, "fp8-rowwise") == len(picked) == 4
    swapped = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert swapped == picked


@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_a_model_too_narrow_for_fp8_is_refused_naming_torchaos_size_rules(precision):
    pytest.importorskip("torchao")
    model = on_meta(GPT(**NARROW_GPT).build_model)
    with pytest.raises(KnobError, match="torchao's size rules") as refused:
        convert_fp8(model, precision)
    assert "\n" not in str(refused.value) and "128x128" in str(refused.value)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


# -- on a GPU with fp8 tensor cores -------------------------------------------------------------


def needs_fp8_gpu() -> torch.device:
    pytest.importorskip("torchao")
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 (Ada, Hopper or newer)")
    return device


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_fp8_trains_a_wide_llama_with_float8_layers(precision):
    device = needs_fp8_gpu()
    pytest.importorskip("transformers")
    knobs = Knobs(batch_size=4, micro_batch_size=2, precision=precision)
    with TrainStep(Llama(**WIDE_LLAMA), knobs, device) as step:
        float8 = [m for m in step.model.modules() if type(m).__name__ == "Float8Linear"]
        assert step.fp8_layers > 0 and len(float8) == step.fp8_layers
        for _ in range(3):
            step()
        loss, grads = step.loss_and_grads()
    assert math.isfinite(loss)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_fp8_computes_the_fp32_step_within_its_tolerance(precision):
    device = needs_fp8_gpu()
    pytest.importorskip("transformers")
    knobs = Knobs(batch_size=4, micro_batch_size=2, precision=precision)
    report = check_fidelity(Llama(**WIDE_LLAMA), knobs, device)
    assert report.ok, report.reason


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision", list(FP8_PRECISIONS))
def test_fp8_on_a_gpt_too_narrow_for_it_is_refused(precision):
    device = needs_fp8_gpu()
    with pytest.raises(KnobError, match="torchao's size rules"):
        TrainStep(GPT(**NARROW_GPT), Knobs(batch_size=2, precision=precision), device)
