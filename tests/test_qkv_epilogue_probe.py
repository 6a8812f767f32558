"""benchmarks/qkv_epilogue_probe.py in smoke mode (CPU, Triton's interpreter): a row per epilogue config, each config's
outputs equal to the pick's, and the bytes the formula counts; then the whole qkv_rope with every position's q and
with the last position's alone."""

import json

from fuselm.ops import decode_linear
from tests.helpers import benchmark_script


def test_smoke_run_times_every_config(monkeypatch, tmp_path):
    probe = benchmark_script("qkv_epilogue_probe", monkeypatch)
    out = tmp_path / "probe.json"
    monkeypatch.setattr("sys.argv", ["qkv_epilogue_probe.py", "--smoke", "--out", str(out)])
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    whole_op = [r for r in rows if r["what"] == "qkv_rope"]
    rows = [r for r in rows if r["what"] == "epilogue"]
    assert [(r["last_only"], r["q_shape"]) for r in whole_op] == [(False, [2, 4, 40, 16]), (True, [2, 4, 1, 16])]
    assert all(r["us"] > 0 for r in whole_op)
    configs = decode_linear._qkv_epilogue_kernel.configs
    assert [r["config"]["BLOCK_M"] for r in rows] == [c.kwargs["BLOCK_M"] for c in configs]
    assert all(r["equal_to_pick"] and r["us"] > 0 for r in rows)
    batch, seq_len = rows[0]["batch"], rows[0]["seq_len"]
    heads, kv_heads, head_dim = 4, 2, 16  # the smoke shapes; fp32
    assert rows[0]["bytes"] == 2 * batch * seq_len * (heads + 2 * kv_heads) * head_dim * 4 + 2 * seq_len * head_dim * 4
