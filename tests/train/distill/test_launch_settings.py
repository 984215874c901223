"""Launch settings resolved per process: train.mixed_precision=auto (kernels.precision) and train.num_threads=auto."""

import pytest

from draftsmith.kernels import precision
from draftsmith.train.distill.launch import resolve_mixed_precision


@pytest.mark.parametrize("fast, expected", [(True, "bf16"), (False, "no")])
def test_auto_is_what_the_device_runs_fast(monkeypatch, fast, expected):
    probed = []
    monkeypatch.setattr(precision, "_bf16_probe", lambda kind: probed.append(kind) or (fast, 0.5 if fast else 40.0))
    assert resolve_mixed_precision("auto", cpu=True) == expected
    assert resolve_mixed_precision("auto", cpu=False) == expected
    assert probed == ["cpu", "cuda"]


def test_explicit_settings_pass_through_unprobed(monkeypatch):
    monkeypatch.setattr(precision, "_bf16_probe", lambda kind: pytest.fail("an explicit setting was probed"))
    assert [resolve_mixed_precision(m, cpu=True) for m in ("bf16", "no", "fp16")] == ["bf16", "no", "fp16"]


def test_training_threads_are_the_process_share_of_the_cores(monkeypatch):
    from draftsmith.train.distill import launch

    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert launch.training_threads("auto") == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.training_threads("auto") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert launch.training_threads("auto") == 1
    assert launch.training_threads(3) == 3
