"""search.launch: the worker of each rank keeps one GPU of those its engine shows it."""

import pytest

from search import launch


def test_a_worker_shown_several_gpus_keeps_the_one_of_its_rank():
    env = {"CUDA_VISIBLE_DEVICES": "4, 5,6", "PATH": "/bin"}
    assert launch.pin(1, env) == {"CUDA_VISIBLE_DEVICES": "5", "PATH": "/bin"}
    assert launch.pin(0, env)["CUDA_VISIBLE_DEVICES"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "4, 5,6"  # the caller's mapping is left alone


@pytest.mark.parametrize("visible", [None, "", "3", "GPU-8f1c2d3e"])
def test_one_gpu_or_none_is_left_as_the_engine_set_it(visible):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert launch.pin(2, env) == env


def test_more_workers_than_gpus_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="worker 2 has no GPU of its own: 2 visible"):
        launch.pin(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
