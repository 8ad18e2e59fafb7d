"""The recommendation in the words of the trainer its user already runs: keyword arguments of
``transformers.TrainingArguments`` (``best.hf_trainer.json``) and of Lightning's ``Trainer``
(``best.lightning.json``), beside ``best.yaml``.

Each file holds ``arguments`` (to pass as ``**arguments``) and ``not_expressed``: a line for each
knob of the recommendation that the trainer has no argument for, saying where it goes instead.
The batch stays the optimizer's batch: the micro-batch is what one forward and backward takes, and
the accumulation steps make up the rest, so the effective batch is the one the search measured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "HF_TRAINER_FILE",
    "LIGHTNING_FILE",
    "hf_trainer_arguments",
    "hf_trainer_line",
    "lightning_trainer_arguments",
    "write_trainer_files",
]

HF_TRAINER_FILE = "best.hf_trainer.json"
LIGHTNING_FILE = "best.lightning.json"

Words = tuple[dict[str, Any], dict[str, str]]
"""A trainer's keyword arguments, and a line for each knob it has none for."""


def _batches(config: Mapping[str, Any]) -> tuple[int, int]:
    """(micro-batch, accumulation steps): one forward and backward's samples, and how many make
    up the optimizer's batch."""
    batch = int(config["batch_size"])
    micro = int(config.get("micro_batch_size") or batch)
    return micro, batch // micro


def _budget_note(recompute: str) -> str:
    """What to set for ``budget-F`` (no trainer has an argument for it); '' for another setting."""
    if not recompute.startswith("budget-"):
        return ""
    fraction = recompute.removeprefix("budget-")
    return (
        f"{recompute}: torch._functorch.config.activation_memory_budget = {fraction} before the "
        "model is compiled (the compiler's partitioner recomputes the rest; no checkpointing)"
    )


def _recompute(config: Mapping[str, Any]) -> str:
    value = config.get("recompute", "none")
    return {True: "all", False: "none"}.get(value, str(value)) if isinstance(value, bool) else value


def hf_trainer_arguments(config: Mapping[str, Any]) -> Words:
    """``config`` as ``TrainingArguments`` keyword arguments, and what they cannot say."""
    micro, steps = _batches(config)
    arguments: dict[str, Any] = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": steps,
    }
    notes: dict[str, str] = {}
    precision = str(config.get("precision", "fp32"))
    # always said: the Trainer turns TF32 on by itself where it compiles, which is not what an
    # fp32 or bf16 configuration measured
    arguments["tf32"] = precision == "tf32"
    if precision in ("bf16", "fp16"):
        arguments[precision] = True
    elif precision.startswith("fp8"):
        arguments["bf16"] = True
        notes["precision"] = (
            f"{precision}: torchao's float8 training of the linear layers "
            "(torchao.float8.convert_to_float8_training) on the model before the Trainer, "
            "under bf16"
        )
    recompute = _recompute(config)
    budget = _budget_note(recompute)
    if budget:
        notes["recompute"] = budget
    elif recompute != "none":
        arguments["gradient_checkpointing"] = True
        if recompute != "all":
            notes["recompute"] = (
                f"{recompute}: the Trainer checkpoints every layer; the recompute measured "
                "kept part of them, set it on the model instead"
            )
    _hf_compile(config, arguments)
    # always said: the Trainer's own default is the fused AdamW on torch 2.8 and newer, which is
    # not what torch's own choice measured
    optimizer = str(config.get("optimizer", "default"))
    arguments["optim"] = "adamw_torch_fused" if optimizer == "fused" else "adamw_torch"
    if optimizer in ("foreach", "for-loop"):
        flag = "foreach=True" if optimizer == "foreach" else "foreach=False"
        notes["optimizer"] = f"{optimizer}: optim_args or your own torch.optim.AdamW({flag})"
    if str(config.get("kernels", "torch")) == "liger":
        arguments["use_liger_kernel"] = True
    _common_notes(config, notes, "attn_implementation on the model (from_pretrained or the config)")
    return arguments, notes


def _hf_compile(config: Mapping[str, Any], arguments: dict[str, Any]) -> None:
    mode = str(config.get("compile", "off"))
    if mode != "off":
        arguments["torch_compile"] = True
        if mode != "default":
            arguments["torch_compile_mode"] = mode


def _common_notes(config: Mapping[str, Any], notes: dict[str, str], attention_where: str) -> None:
    """The knobs neither trainer has an argument for: lanes and the attention kernel."""
    streams = int(config.get("streams", 1))
    if streams > 1:
        notes["streams"] = (
            f"{streams}: micro-batches run on {streams} concurrent lanes (CUDA streams); no "
            "trainer argument runs them so: run with one lane, or in a training loop of your own"
        )
    attention = str(config.get("attention", "default"))
    if attention != "default":
        notes["attention"] = (
            f"{attention}: scaled_dot_product_attention's kernel, set with "
            f"torch.nn.attention.sdpa_kernel around the step or {attention_where}"
        )


LIGHTNING_PRECISION = {
    "fp32": "32-true",
    "tf32": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
}


def lightning_trainer_arguments(config: Mapping[str, Any]) -> Words:
    """``config`` as Lightning ``Trainer`` keyword arguments, and what they cannot say."""
    micro, steps = _batches(config)
    precision = str(config.get("precision", "fp32"))
    arguments: dict[str, Any] = {
        "precision": LIGHTNING_PRECISION.get(precision, "bf16-mixed"),
        "accumulate_grad_batches": steps,
    }
    notes = {
        "micro_batch_size": f"{micro}: the DataLoader's batch_size (DataLoader(..., "
        f"batch_size={micro})); the Trainer accumulates {steps} of them per optimizer step",
    }
    if precision == "tf32":
        notes["precision"] = (
            'tf32: torch.set_float32_matmul_precision("high") before fit, with precision 32-true'
        )
    elif precision.startswith("fp8"):
        notes["precision"] = (
            f"{precision}: torchao's float8 training of the linear layers "
            "(torchao.float8.convert_to_float8_training) on the model, under bf16-mixed"
        )
    recompute = _recompute(config)
    budget = _budget_note(recompute)
    if budget:
        notes["recompute"] = budget
    elif recompute != "none":
        notes["recompute"] = (
            f"{recompute}: activation checkpointing in the LightningModule "
            "(torch.utils.checkpoint around its blocks, or the model's own switch)"
        )
    mode = str(config.get("compile", "off"))
    if mode != "off":
        mode_arg = "" if mode == "default" else f', mode="{mode}"'
        notes["compile"] = f"{mode}: model = torch.compile(model{mode_arg}) before trainer.fit"
    optimizer = str(config.get("optimizer", "default"))
    if optimizer in ("fused", "foreach"):
        notes["optimizer"] = (
            f"{optimizer}: torch.optim.AdamW(..., {optimizer}=True) in configure_optimizers"
        )
    if str(config.get("kernels", "torch")) == "liger":
        notes["kernels"] = "liger: liger_kernel.transformers.apply_liger_kernel_to_<arch>()"
    _common_notes(config, notes, "the model's attention setting")
    return arguments, notes


def hf_trainer_line(config: Mapping[str, Any]) -> str:
    """One line a summary prints: ``TrainingArguments(...)`` with the recommendation's values."""
    arguments, notes = hf_trainer_arguments(config)
    shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    rest = f" (and {', '.join(notes)}: see {HF_TRAINER_FILE})" if notes else ""
    return f"TrainingArguments({shown}){rest}"


def write_trainer_files(study_dir: Path, config: Mapping[str, Any] | None) -> list[Path]:
    """``best.hf_trainer.json`` and ``best.lightning.json`` for ``config`` (the recommendation);
    none where there is no recommendation (removed where an earlier run left them), or where it
    is not a training configuration (no batch)."""
    paths = [study_dir / HF_TRAINER_FILE, study_dir / LIGHTNING_FILE]
    if config is None or "batch_size" not in config:
        for path in paths:
            path.unlink(missing_ok=True)
        return []
    for path, (arguments, notes) in zip(
        paths, (hf_trainer_arguments(config), lightning_trainer_arguments(config)), strict=True
    ):
        payload = {"arguments": arguments, "not_expressed": notes, "config": dict(config)}
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return paths
