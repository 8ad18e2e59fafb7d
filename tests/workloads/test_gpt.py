import math

import pytest
import torch
from conformance import WorkloadConformance

from search.workloads import GPT

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)


class TestGPT(WorkloadConformance):
    def make_workload(self):
        return GPT(**TINY)


def test_n_heads_that_does_not_divide_d_model_is_rejected():
    with pytest.raises(ValueError, match=r"d_model % n_heads == 0.*d_model=32, n_heads=3"):
        GPT(**{**TINY, "n_heads": 3})


@pytest.mark.parametrize("field", ["vocab_size", "seq_len", "n_layers"])
def test_non_positive_sizes_are_rejected(field):
    with pytest.raises(ValueError, match=f"`{field}` must be an int >= 1"):
        GPT(**{**TINY, field: 0})


def test_loss_at_init_is_near_ln_vocab():
    workload = GPT(**TINY)
    torch.manual_seed(0)
    model = workload.build_model()
    loss = workload.loss(model, workload.make_batch(8, torch.Generator().manual_seed(0)))
    # Random targets: a model that knows nothing predicts uniformly, loss = ln(vocab_size).
    assert loss.item() == pytest.approx(math.log(TINY["vocab_size"]), abs=0.1)


def test_batch_has_one_extra_token_per_row_within_the_vocabulary():
    batch = GPT(**TINY).make_batch(3, torch.Generator().manual_seed(0))
    assert batch.shape == (3, TINY["seq_len"] + 1) and batch.dtype == torch.long
    assert 0 <= batch.min() and batch.max() < TINY["vocab_size"]


def test_items_are_tokens_per_sequence():
    workload = GPT(**TINY)
    assert workload.unit == "tokens" and workload.items_per_sample() == TINY["seq_len"]


def test_output_embedding_is_tied_to_the_input_embedding():
    model = GPT(**TINY).build_model()
    n_embedding = TINY["vocab_size"] * TINY["d_model"]
    # Tied: the vocabulary matrix is counted once, so there is no second vocab x d_model weight.
    big = [p for p in model.parameters() if p.numel() == n_embedding]
    assert len(big) == 1


def test_recompute_modules_are_the_blocks():
    workload = GPT(**TINY)
    model = workload.build_model()
    assert len(workload.recompute_modules(model)) == TINY["n_layers"]


def test_attention_is_causal():
    workload = GPT(**TINY)
    model = workload.build_model().eval()
    tokens = workload.make_batch(1, torch.Generator().manual_seed(0))[:, :-1]
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    # Changing the last token must leave every earlier position's logits unchanged, and only those.
    torch.testing.assert_close(after[:, :-1], before[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, -1], before[:, -1])
