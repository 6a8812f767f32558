"""benchmarks/step_profile.py's layer chain: each layer kernel's role (o or down for linear_residual, by what ran
before it), its span, its start against the previous kernel's end and what it adds to the critical path."""

from fuselm.profiling import Launch
from tests.helpers import benchmark_script


def test_chain_reads_each_kernels_marginal_time(monkeypatch):
    step_profile = benchmark_script("step_profile", monkeypatch)
    layer = [("_qkv_rope_kernel", 20.0), ("_decode_attention_kernel", 8.0), ("_linear_residual_kernel", 14.0),
             ("_norm_gated_kernel", 60.0), ("_linear_residual_kernel", 40.0)]
    launches, clock = [Launch("opening_kernel", "other", 0.0, 2.0)], 2.0
    for _ in range(2):  # each kernel starts 3 us before the one before it ends (a dependent launch)
        for name, duration in layer:
            launches.append(Launch(name, "fuselm", clock - 3.0, clock - 3.0 + duration))
            clock = clock - 3.0 + duration
    found = step_profile.chain(launches[::-1])  # any order in: sorted by start
    assert set(found) == {"qkv_rope", "attention", "o", "gate_up", "down"}
    assert found["o"] == {"duration_us": 14.0, "starts_after_previous_end_us": -3.0, "marginal_us": 11.0, "launches": 2}
    assert found["down"]["marginal_us"] == 37.0 and found["gate_up"]["marginal_us"] == 57.0
    assert found["qkv_rope"]["launches"] == 1  # the first layer's qkv follows the opening kernel: left out
