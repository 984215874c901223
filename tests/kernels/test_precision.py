"""`auto` bf16 settings follow the device's measured bf16 speed; explicit ones are kept; bad ones name the field."""

import logging

import pytest

from draftsmith.kernels import precision


@pytest.fixture
def bf16_speed(monkeypatch):
    """Script the probe: set(fast) makes bf16 fast (ratio 0.5) or slow (ratio 40) on every device type."""
    calls = []

    def set_speed(fast: bool) -> None:
        def probe(kind: str):
            calls.append(kind)
            return (True, 0.5) if fast else (False, 40.0)
        monkeypatch.setattr(precision, "_bf16_probe", probe)
    set_speed.calls = calls
    return set_speed


@pytest.mark.parametrize("value, parsed", [(True, True), (False, False), ("auto", "auto"), ("AUTO", "auto"),
                                           ("true", True), ("False", False), ("bf16", True), ("no", False)])
def test_settings_parse(value, parsed):
    assert precision.parse_bf16_setting(value, "target.bf16_autocast") == parsed


def test_a_bad_setting_names_its_field():
    with pytest.raises(ValueError, match=r"data\.teacher_bf16: 'maybe' is not true, false or 'auto'"):
        precision.resolve_bf16("maybe", "cpu", "data.teacher_bf16")


@pytest.mark.parametrize("fast", [True, False])
def test_auto_follows_the_probe(bf16_speed, fast):
    bf16_speed(fast)
    assert precision.resolve_bf16("auto", "cpu", "target.bf16_autocast") is fast
    assert precision.bf16_is_fast("cpu") is fast


def test_false_never_probes_and_true_on_a_slow_device_warns_but_is_kept(bf16_speed, caplog):
    bf16_speed(False)
    assert precision.resolve_bf16(False, "cpu", "target.bf16_autocast") is False
    assert bf16_speed.calls == []
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        assert precision.resolve_bf16(True, "cpu", "target.bf16_autocast") is True
    assert "target.bf16_autocast=true" in caplog.text and "40.0x slower than fp32" in caplog.text


def test_the_real_probe_measures_once_per_device_type():
    precision._bf16_probe.cache_clear()
    first = precision._bf16_probe("cpu")
    assert isinstance(first[0], bool) and first[1] > 0
    assert first[0] == (first[1] < 1.0)
    assert precision._bf16_probe("cpu") == first
    assert precision._bf16_probe.cache_info().hits >= 1
