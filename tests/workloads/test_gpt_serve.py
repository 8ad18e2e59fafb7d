import pytest
from conformance import ServingConformance

from search.workloads import GPTServe

TINY = dict(vocab_size=64, prompt_len=8, gen_len=4, d_model=32, n_layers=2, n_heads=2)


class TestGPTServeCached(ServingConformance):
    def make_workload(self):
        return GPTServe(**TINY, kv_cache=True)


class TestGPTServeUncached(ServingConformance):
    def make_workload(self):
        return GPTServe(**TINY, kv_cache=False)


def test_the_reference_is_the_same_model_without_a_cache():
    reference = GPTServe(**TINY, kv_cache=True).reference()
    assert reference.config == {**GPTServe(**TINY).config, "kv_cache": False}


@pytest.mark.parametrize("field", ["prompt_len", "gen_len"])
def test_non_positive_lengths_are_rejected(field):
    with pytest.raises(ValueError, match=f"`{field}` must be an int >= 1"):
        GPTServe(**{**TINY, field: 0})


def test_kv_cache_must_be_a_bool():
    with pytest.raises(ValueError, match="kv_cache"):
        GPTServe(**TINY, kv_cache="yes")
