"""benchmarks/ttft_probe.py in smoke mode (a tiny model on the CPU): one row per call path and prefill path, each
with its times, and the fused prefill attention switched off only where asked."""

import contextlib
import json
from unittest import mock

import torch

import fuselm
from fuselm.generation import FusedKVCache
from fuselm.patching import decode
from tests.helpers import benchmark_script
from tests.models import decode_model, token_ids
from tests.patching.test_decode import CACHE_ARG


def test_smoke_run_writes_a_row_per_path(monkeypatch, tmp_path):
    probe = benchmark_script("ttft_probe", monkeypatch)
    out = tmp_path / "ttft.json"
    monkeypatch.setattr("sys.argv", ["ttft_probe.py", "--smoke", "--layers", "2", "--prompt", "24", "--repeats", "1",
                                     "--grow-to", "40", "--cprofile", "--host-parts", "--out", str(out)])
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(row["impl"], row["prefill"], row["mode"]) for row in rows] == [
        (impl, path, mode) for path, mode in probe.PATHS for impl in probe.IMPLS]
    for row in rows:
        assert row["replayed"] is False  # the CPU has no graphs
        assert row["event_ms"] > 0 and row["wall_ms"] > 0 and row["span_ms"] > 0 and row["lead_ms"] >= 0
        assert row["grow_to"] == 40
        assert sorted(row["phases"]) == sorted(f"{phase}_{clock}_ms" for phase in ("lead", "forward", "tail")
                                               for clock in ("event", "host"))
        assert all(value > 0 for value in row["phases"].values())
        if row["mode"] == "graph":
            assert "host_parts" not in row
            continue
        parts = row["host_parts"]
        assert parts["layer"]["calls"] == 2 and parts["nn.Linear (all)"]["calls"] > 0
        assert parts["layer"]["ms"] >= parts["  mlp"]["ms"] > 0


def test_a_batch_of_prompts_prefills_together(monkeypatch, tmp_path):
    probe = benchmark_script("ttft_probe", monkeypatch)
    out = tmp_path / "ttft.json"
    monkeypatch.setattr("sys.argv", ["ttft_probe.py", "--smoke", "--layers", "2", "--prompt", "12", "--batch", "3",
                                     "--repeats", "1", "--out", str(out)])
    prompts = []
    call = probe.e2e.call
    monkeypatch.setattr(probe.e2e, "call", lambda model, impl, prompt, new: prompts.append(prompt.shape) or
                        call(model, impl, prompt, new))
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(probe.PATHS) * len(probe.IMPLS)
    assert all(row["batch"] == 3 and row["prompt"] == 12 for row in rows)
    assert set(prompts) == {torch.Size([3, 12])}


def test_the_switch_sends_prefills_to_hf_attention_and_back(monkeypatch):
    """Under ``fused_prefill_off`` a prefill into an empty cache runs HF's attention; after it, the fused prefill
    attention again; a decode step takes the fused decode step either way."""
    probe = benchmark_script("ttft_probe", monkeypatch)
    model = decode_model("llama")
    fuselm.patch(model)
    ids = token_ids(1, 24)

    def counts(switched: bool) -> tuple[int, int]:
        cache = FusedKVCache(model, 1, 32)
        cache.plan()
        with (probe.fused_prefill_off() if switched else contextlib.nullcontext(),
              mock.patch.object(decode, "prefill_attention", wraps=decode.prefill_attention) as prefill,
              mock.patch.object(decode, "decode_step", wraps=decode.decode_step) as step, torch.no_grad()):
            model(ids, **{CACHE_ARG: cache})
            model(ids[:, :1], **{CACHE_ARG: cache})
        return prefill.call_count, step.call_count

    layers = model.config.num_hidden_layers
    assert counts(switched=True) == (0, layers)
    assert counts(switched=False) == (layers, layers)


def test_the_span_runs_to_the_later_of_the_return_and_the_last_kernel(monkeypatch):
    probe = benchmark_script("ttft_probe", monkeypatch)
    from fuselm.profiling import Launch

    kernels = [Launch("a", "other", 12.0, 20.0), Launch("b", "other", 21.0, 95.0)]
    assert probe.profiled_span_us(10.0, 30.0, kernels) == 85.0  # a graph: the host returned at 30, the GPU ran on
    assert probe.profiled_span_us(10.0, 130.0, kernels) == 120.0
    assert probe.profiled_span_us(10.0, 30.0, []) == 20.0
