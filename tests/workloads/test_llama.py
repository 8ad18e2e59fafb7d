import math

import pytest
import torch
from conformance import WorkloadConformance

from search.execution.knobs import Knobs
from search.execution.recompute import recompute_targets
from search.execution.train_step import TrainStep
from search.workloads import Llama

pytest.importorskip("transformers")

TINY = dict(
    vocab_size=64,
    seq_len=16,
    hidden_size=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    intermediate_size=64,
)
CPU = torch.device("cpu")


class TestLlama(WorkloadConformance):
    def make_workload(self):
        return Llama(**TINY)


def test_loss_at_init_is_near_ln_vocab():
    workload = Llama(**TINY)
    torch.manual_seed(0)
    model = workload.build_model()
    loss = workload.loss(model, workload.make_batch(8, torch.Generator().manual_seed(0)))
    assert loss.item() == pytest.approx(math.log(TINY["vocab_size"]), abs=0.2)


def test_the_model_is_transformers_llama_with_grouped_key_value_heads():
    model = Llama(**TINY).build_model()
    assert type(model).__name__ == "LlamaForCausalLM"
    attention = model.model.layers[0].self_attn
    head_dim = TINY["hidden_size"] // TINY["n_heads"]
    assert attention.k_proj.out_features == TINY["n_kv_heads"] * head_dim


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("none", 0),
        ("all", 4),
        ("every-2", 2),
        ("every-3", 2),
        ("attention", 4),
        ("mlp", 4),
        ("selective", 4),
    ],
)
def test_each_recompute_setting_checkpoints_its_modules(setting, expected):
    workload = Llama(**TINY)
    model = workload.build_model()
    targets = recompute_targets(workload, model, setting)
    assert len(targets) == expected
    if setting == "every-2":  # blocks 0 and 2, torchtitan's layer_id % K == 0
        layers = list(model.model.layers)
        assert [layers.index(t) for t in targets] == [0, 2]


@pytest.mark.parametrize(
    ("setting", "mlp_forwards"),
    [("none", 4), ("every-2", 6), ("all", 8), ("mlp", 8), ("attention", 4)],
)
def test_recompute_runs_the_recomputed_forwards_again_in_backward(setting, mlp_forwards):
    with TrainStep(Llama(**TINY), Knobs(batch_size=2, recompute=setting), CPU) as step:
        calls = []
        for layer in step.model.model.layers:
            layer.mlp.gate_proj.register_forward_hook(lambda *_: calls.append(1))
        step()
    assert len(calls) == mlp_forwards  # 4 layers, each recomputed one once more


def _silus_and_flops(setting: str) -> tuple[int, int]:
    """How many SiLUs a training step ran (forward, and again where recomputed) and its FLOPs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class Silus(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Silus.count += func is torch.ops.aten.silu.default
            return func(*args, **(kwargs or {}))

    with TrainStep(Llama(**TINY), Knobs(batch_size=2, recompute=setting), CPU) as step:
        step()  # warm: the optimizer's state is built
        flops = FlopCounterMode(display=False)
        with flops, Silus():
            step()
    return Silus.count, flops.get_total_flops()


def test_selective_recompute_keeps_the_matrix_products_and_recomputes_the_rest():
    """``selective`` runs every block's cheap operators again in backward (each layer's SiLU
    twice, as ``all`` does) but none of its matrix products: the step's FLOPs are those of the
    step that keeps everything, where ``all`` adds another forward's."""
    none_silus, none_flops = _silus_and_flops("none")
    silus, flops = _silus_and_flops("selective")
    all_silus, all_flops = _silus_and_flops("all")
    assert (none_silus, silus, all_silus) == (4, 8, 8)
    assert flops == none_flops < all_flops


@pytest.mark.parametrize("field", ["vocab_size", "seq_len", "n_layers", "n_kv_heads"])
def test_non_positive_sizes_are_rejected(field):
    with pytest.raises(ValueError, match=f"`{field}` must be an int >= 1"):
        Llama(**{**TINY, field: 0})


def test_key_value_heads_that_do_not_divide_the_heads_are_rejected():
    with pytest.raises(ValueError, match=r"n_heads % n_kv_heads == 0"):
        Llama(**{**TINY, "n_kv_heads": 3})


def test_flops_per_token_count_grouped_projections_and_the_untied_head():
    c = TINY
    d, kv = c["hidden_size"], c["hidden_size"] // c["n_heads"] * c["n_kv_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * c["intermediate_size"]
    weights = c["n_layers"] * per_layer + c["vocab_size"] * d
    expected = 6 * weights + 12 * c["n_layers"] * d * c["seq_len"]
    assert Llama(**TINY).flops_per_item() == expected
    # the matrix weights the model holds, embeddings and norms aside
    model = Llama(**TINY).build_model()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == weights
