"""benchmarks/timing.py's one-shot timer: it calls the function once and measures at least the time it spends."""

import time

from tests.helpers import benchmark_script


def test_once_ms_calls_once_and_covers_the_call(monkeypatch):
    timing = benchmark_script("timing", monkeypatch)
    calls = []
    ms = timing.once_ms(lambda: (calls.append(1), time.sleep(0.02)), cuda=False)
    assert calls == [1]
    assert ms >= 20.0  # a clock lower bound (the call sleeps 20 ms), not a speed check
