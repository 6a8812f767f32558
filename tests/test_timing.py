"""benchmarks/timing.py: the one-shot timer calls the function once and measures at least the time it spends; the
clock sampler summarises only the nvidia-smi samples inside a span, skipping lines it cannot read."""

import subprocess
import time

from tests.helpers import benchmark_script


def test_once_ms_calls_once_and_covers_the_call(monkeypatch):
    timing = benchmark_script("timing", monkeypatch)
    calls = []
    ms = timing.once_ms(lambda: (calls.append(1), time.sleep(0.02)), cuda=False)
    assert calls == [1]
    assert ms >= 20.0  # a clock lower bound (the call sleeps 20 ms), not a speed check


def test_clock_sampler_summarises_the_samples_in_a_span(monkeypatch):
    timing = benchmark_script("timing", monkeypatch)

    def no_smi(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "Popen", no_smi)
    sampler = timing.ClockSampler()
    assert sampler.process is None
    sampler.samples = [(1.0, "1980 MHz, 300.00 W, 0x0000000000000000"),
                       (2.0, "1350 MHz, 699.50 W, 0x0000000000000004"),
                       (2.5, "[N/A], [N/A], [N/A]"),
                       (3.0, "1410 MHz, 690.25 W, 0x0000000000000004"),
                       (9.0, "1755 MHz, 500.00 W, 0x0000000000000000")]
    assert sampler.between(1.5, 3.0) == {
        "samples": 2, "sm_mhz_min": 1350.0, "sm_mhz_median": 1380.0, "watts_max": 699.5, "watts_median": 694.875,
        "throttle": ["0x0000000000000004"]}
    assert sampler.between(4.0, 8.0) == {"samples": 0}
    assert sampler.within([(0.5, 1.5), (8.0, 9.5)]) == {  # two calls' decode phases: the samples of both, merged
        "samples": 2, "sm_mhz_min": 1755.0, "sm_mhz_median": 1867.5, "watts_max": 500.0, "watts_median": 400.0,
        "throttle": ["0x0000000000000000"]}
    sampler.stop()
