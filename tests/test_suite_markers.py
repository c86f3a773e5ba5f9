"""The suite's own markers (tests/conftest.py): ``gpu_timing`` tests skip where several xdist
workers share the GPU and run where the suite has it to itself."""
import pytest

from tests import conftest


class _Item:
    def __init__(self, *markers):
        self.markers = {m: pytest.Mark(m, (), {}) for m in markers}
        self.added = []

    def get_closest_marker(self, name):
        return self.markers.get(name)

    def add_marker(self, mark):
        self.added.append(mark)


@pytest.mark.parametrize("workers, skipped", [(None, False), ("1", False), ("16", True)])
def test_timing_tests_skip_only_where_workers_share_the_gpu(monkeypatch, workers, skipped):
    from stableflash.attention.triton import launch_cache
    monkeypatch.setattr(conftest, "cuda_available", lambda: True)
    monkeypatch.setattr(launch_cache, "VERIFY", launch_cache.VERIFY)       # restored after the test
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    timing, gpu, plain = _Item("gpu", "gpu_timing"), _Item("gpu"), _Item()
    conftest.pytest_collection_modifyitems(None, [timing, gpu, plain])
    assert gpu.added == plain.added == []
    if skipped:
        [mark] = timing.added
        assert mark.name == "skip" and f"{workers} xdist workers sharing the GPU" in mark.kwargs["reason"]
    else:
        assert timing.added == []
