"""The ``kernels`` knob: refused where Triton cannot run, in one line; a workload that cannot patch
kernels in is refused before a study starts; Llama's Liger patches stay on its own model (the
fidelity check's plain reference, built after it in the same process, stays plain); and, on a
GPU, a Liger step that trains and computes the fp32 step. Liger-Kernel is imported only by the
GPU tests; the CPU ones stand in for its module-level patching."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from search.config.compose import compose_config, resolve
from search.config.prepare import load_space
from search.core.errors import ConfigError
from search.execution import knobs as execution_knobs
from search.execution.fidelity import check_fidelity
from search.execution.kernels import KERNELS, apply_kernels, kernels_unsupported
from search.execution.knobs import KnobError, Knobs, map_tensors
from search.execution.train_step import TrainStep
from search.workloads import GPT, Llama, hf_kernels

CPU = torch.device("cpu")
TINY_GPT = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
TINY_LLAMA = dict(
    vocab_size=64, seq_len=16, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
    intermediate_size=64,
)  # fmt: skip
SMALL_LLAMA = dict(
    vocab_size=2048, seq_len=128, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2,
    intermediate_size=512,
)  # fmt: skip
PATCHED = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
"""What Liger 0.8.5's apply_liger_kernel_to_llama sets in transformers' Llama module."""
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# -- where liger cannot run ---------------------------------------------------------------------


def test_a_cpu_cannot_run_liger_and_says_so_in_one_line():
    reason = kernels_unsupported("liger", CPU)
    assert reason and "\n" not in reason and "CUDA" in reason


@pytest.mark.parametrize("value", ["torch", "other"])
def test_torch_runs_anywhere_and_an_unknown_name_is_left_to_the_value_rule(value):
    # an unknown name is refused by value_rule with the list of choices, not as a device's fault
    assert kernels_unsupported(value, CPU) is None
    assert kernels_unsupported(value, torch.device("cuda")) is None


def test_the_choices_are_torch_and_liger():
    assert KERNELS == ("torch", "liger")


def test_a_train_step_refuses_liger_on_a_cpu_before_building_anything():
    with pytest.raises(KnobError, match="kernels='liger' cannot run on cpu") as refused:
        TrainStep(Llama(**TINY_LLAMA), Knobs(batch_size=2, kernels="liger"), CPU)
    assert "\n" not in str(refused.value)


def test_torch_kernels_leave_the_model_as_built():
    model = GPT(**TINY_GPT).build_model()
    before = {name: type(m) for name, m in model.named_modules()}
    apply_kernels(GPT(**TINY_GPT), model, "torch")
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert "forward" not in model.__dict__


def test_a_workload_without_use_kernels_cannot_patch_them_in():
    model = GPT(**TINY_GPT).build_model()
    with pytest.raises(NotImplementedError, match="GPT names no fused kernels"):
        apply_kernels(GPT(**TINY_GPT), model, "liger")


def test_llama_names_no_other_kernels():
    with pytest.raises(NotImplementedError, match="no kernels called 'other'"):
        Llama(**TINY_LLAMA).use_kernels(torch.nn.Linear(2, 2), "other")


def test_a_space_searching_liger_over_a_workload_without_use_kernels_is_refused(monkeypatch):
    # As on a GPU with liger installed: the device runs every kernels choice.
    monkeypatch.setitem(execution_knobs._DEVICE_REFUSALS, "kernels", lambda value, device: None)
    cfg = compose_config(
        [
            "+space=llm",
            "preset=cpu",
            "+space.params.kernels={type:categorical,choices:[torch,liger]}",
        ]
    )
    with pytest.raises(ConfigError, match="implement use_kernels") as refused:
        load_space(resolve(cfg)["space"], CPU)
    assert "\n" not in str(refused.value) and "search.workloads.GPT" in str(refused.value)


# -- Llama's patches stay on its model (a stand-in for Liger's module-level patching) ----------


@pytest.fixture
def modeling_llama(monkeypatch):
    """transformers' Llama module, its patched names and the plain values kept by
    ``search.workloads.hf_kernels`` put back after the test."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    for name in PATCHED:
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(hf_kernels, "_PLAIN", {})
    return modeling_llama


def plain_rope(modeling_llama):
    kept = (modeling_llama.__name__, "apply_rotary_pos_emb")
    return hf_kernels._PLAIN.get(kept, modeling_llama.apply_rotary_pos_emb)


def liger_rope_of(model):
    """The rotary function a Liger patch kept on ``model`` for its own forward passes."""
    return model.liger_globals["apply_rotary_pos_emb"]


def fake_liger(monkeypatch, modeling_llama, calls):
    """A ``liger_kernel.transformers`` that patches as Liger 0.8.5 does given a model (the three
    module names, the model's forward), with a rotary function that counts its calls and computes
    transformers' own."""
    rope = modeling_llama.apply_rotary_pos_emb

    def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls.append("liger")
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    class LigerRMSNorm(torch.nn.Module): ...

    class LigerSwiGLUMLP(torch.nn.Module): ...

    def apply_liger_kernel_to_llama(model=None):
        modeling_llama.apply_rotary_pos_emb = liger_rope
        modeling_llama.LlamaRMSNorm = LigerRMSNorm
        modeling_llama.LlamaMLP = LigerSwiGLUMLP
        model.forward = model.forward  # the fused loss's forward, on this model alone

    module = types.ModuleType("liger_kernel.transformers")
    module.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return liger_rope


def test_use_kernels_puts_transformers_module_back_and_keeps_the_rope_on_the_model(
    monkeypatch, modeling_llama
):
    plain = {name: getattr(modeling_llama, name) for name in PATCHED}
    liger_rope = fake_liger(monkeypatch, modeling_llama, [])
    workload = Llama(**TINY_LLAMA)
    patched = workload.build_model()
    workload.use_kernels(patched, "liger")
    assert {name: getattr(modeling_llama, name) for name in PATCHED} == plain
    assert liger_rope_of(patched) is liger_rope
    assert set(patched.liger_globals) == {"apply_rotary_pos_emb"}  # the classes stay put back
    fresh: Any = workload.build_model()
    assert type(fresh.model.norm) is plain["LlamaRMSNorm"]
    assert type(fresh.model.layers[0].mlp) is plain["LlamaMLP"]


def test_each_model_runs_its_own_rotary_function_whichever_ran_last(monkeypatch, modeling_llama):
    calls: list[str] = []
    fake_liger(monkeypatch, modeling_llama, calls)
    workload = Llama(**TINY_LLAMA)
    patched, plain = workload.build_model(), workload.build_model()
    workload.use_kernels(patched, "liger")
    batch = workload.make_batch(2, torch.Generator().manual_seed(0))
    for model, expected in [(patched, 2), (plain, 0), (patched, 2), (plain, 0)]:
        calls.clear()
        workload.loss(model, batch).backward()
        assert len(calls) == expected  # one call per layer
        assert (modeling_llama.apply_rotary_pos_emb is plain_rope(modeling_llama)) == (
            model is plain
        )


def test_a_second_liger_model_restores_transformers_rope_not_the_first_ones(
    monkeypatch, modeling_llama
):
    transformers_rope = modeling_llama.apply_rotary_pos_emb
    fake_liger(monkeypatch, modeling_llama, [])
    workload = Llama(**TINY_LLAMA)
    first = workload.build_model()
    workload.use_kernels(first, "liger")
    workload.loss(first, workload.make_batch(1, torch.Generator().manual_seed(0)))
    assert modeling_llama.apply_rotary_pos_emb is liger_rope_of(first)  # left by its forward
    workload.use_kernels(workload.build_model(), "liger")
    assert modeling_llama.apply_rotary_pos_emb is transformers_rope


def test_an_architecture_liger_has_no_kernels_for_is_refused_with_the_ones_it_has(
    monkeypatch, modeling_llama
):
    from search.workloads import HF

    fake_liger(monkeypatch, modeling_llama, [])  # Liger with kernels for llama alone
    tiny = dict(layers=1, width=32, heads=2, vocab_size=64, seq_len=16)
    assert HF(model="gpt2", **tiny).refuses("kernels", "liger") == (
        "Liger-Kernel has no kernels for gpt2 (it has: llama)"
    )
    assert HF(model="llama", **tiny).refuses("kernels", "liger") is None
    assert Llama(**TINY_LLAMA).refuses("kernels", "liger") is None


# -- on a GPU, with Liger-Kernel ----------------------------------------------------------------


def needs_liger() -> torch.device:
    pytest.importorskip("transformers")
    pytest.importorskip("liger_kernel")
    return torch.device("cuda")


@pytest.mark.gpu
@cuda
def test_a_liger_step_trains_with_liger_modules_on_its_model_alone():
    device = needs_liger()
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama

    workload = Llama(**SMALL_LLAMA)
    with TrainStep(workload, Knobs(batch_size=4, kernels="liger"), device) as step:
        model: Any = step.model
        assert model.model.norm._get_name() == "LigerRMSNorm"
        assert model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
        assert liger_rope_of(model) is liger_rotary_pos_emb
        for _ in range(3):
            step()
        loss, grads = step.loss_and_grads()
    assert math.isfinite(loss)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    plain: Any = workload.build_model().to(device)
    assert type(plain.model.norm) is modeling_llama.LlamaRMSNorm
    assert type(plain.model.layers[0].mlp) is modeling_llama.LlamaMLP
    assert modeling_llama.LlamaRMSNorm.__module__ == modeling_llama.__name__
    assert modeling_llama.LlamaMLP.__module__ == modeling_llama.__name__
    assert "forward" not in plain.__dict__ and "forward" not in plain.model.norm.__dict__
    batch = map_tensors(lambda t: t.to(device), workload.make_batch(2, torch.Generator()))
    assert math.isfinite(float(workload.loss(plain, batch)))
    rope = modeling_llama.apply_rotary_pos_emb
    assert rope is not liger_rotary_pos_emb and not rope.__module__.startswith("liger_kernel")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_liger_computes_the_fp32_step_within_the_precisions_tolerance(precision):
    device = needs_liger()
    knobs = Knobs(batch_size=4, micro_batch_size=2, precision=precision, kernels="liger")
    report = check_fidelity(Llama(**SMALL_LLAMA), knobs, device)
    assert report.ok, report.reason
