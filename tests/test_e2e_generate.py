"""benchmarks/e2e.py's generation rows in smoke mode (a tiny fp32 model, CPU): a fuselm impl's prefill rows come
twice, replayed-length and eager, and the eager ones run with prefill graphs off; every impl's prefill comes once more
as single calls after the GPU idled (no wait without a GPU)."""

from types import SimpleNamespace

import pytest

from fuselm.generation import engine as engine_module
from tests.helpers import benchmark_script


@pytest.fixture
def e2e(monkeypatch):
    return benchmark_script("e2e", monkeypatch)


ARGS = SimpleNamespace(batches=[2], prompt=12, new=3, repeats=1, prefills=[20], profile_first_call=False,
                       prefill_idle_s=1.0)


@pytest.mark.parametrize("impl", ["fuselm.generate", "eager"])
def test_generate_and_prefill_rows(e2e, impl):
    model = e2e.build(1, smoke=True)
    if impl == "fuselm.generate":
        import fuselm

        fuselm.patch(model)
    rows: list[dict] = []
    e2e.measure(model, impl, ARGS, rows, copy=1000.0)
    kinds = [(row["what"], row["batch"], row["prompt"]) for row in rows]
    prefills = ([("prefill", 1, 20)] + ([("prefill_eager", 1, 20)] if impl == "fuselm.generate" else [])
                + [("prefill_after_idle", 1, 20)])
    assert kinds == [("first_call_s", 2, 12), ("generate", 2, 12), *prefills]
    assert all(row["impl"] == impl for row in rows)
    assert rows[1]["tok_per_s"] > 0 and all(row["ms"] > 0 for row in rows[2:])
    assert rows[-1]["idle_s"] == 0.0 and len(rows[-1]["ms_all"]) == ARGS.repeats
    # the decode steps' rate: the call less its first token's call (the same prompt, one new token)
    generate = rows[1]
    assert generate["first_token_ms"] > 0
    call_ms = 2 * ARGS.new / generate["tok_per_s"] * 1e3
    assert generate["decode_tok_per_s"] == pytest.approx(2 * (ARGS.new - 1) / ((call_ms - generate["first_token_ms"])
                                                                                / 1e3))


def test_eager_prefills_switch_the_graphs_off_and_back(e2e):
    tokens = engine_module.PREFILL_GRAPH_TOKENS
    with e2e.eager_prefills():
        assert engine_module.PREFILL_GRAPH_TOKENS == 0
    assert engine_module.PREFILL_GRAPH_TOKENS == tokens > 0


def test_the_decode_steps_clocks_cover_each_timed_call_past_its_first_token(e2e, monkeypatch):
    """``clocks_decode`` summarises the samples inside each generate call's host span less its first token's time."""

    class Sampler:
        def __init__(self):
            self.asked = []

        def between(self, start, end):
            return {"samples": 0}

        def within(self, spans):
            self.asked.append(list(spans))
            return {"samples": 1}

    calls, timed_call = [], e2e.timed_call
    monkeypatch.setattr(e2e, "timed_call", lambda spans, *args: (calls.append(spans), timed_call(spans, *args))[1])
    model = e2e.build(1, smoke=True)
    sampler = Sampler()
    rows: list[dict] = []
    e2e.measure(model, "eager", ARGS, rows, copy=1000.0, sampler=sampler)
    generate = rows[1]
    assert generate["what"] == "generate" and generate["clocks_decode"] == {"samples": 1}
    spans = calls[0]
    assert len(spans) >= ARGS.repeats and all(start <= end for start, end in spans)
    assert sampler.asked == [[(start + generate["first_token_ms"] / 1e3, end) for start, end in spans]]
