"""benchmarks/report.py's plots: one PNG per kernel family from the committed kernel results, the decode chart from
e2e results in the generate schema, and a printed line (no plot) for the old schema."""

import json
from pathlib import Path

import pytest

from tests.helpers import benchmark_script

pytest.importorskip("matplotlib")  # [bench], which [test] includes

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    return benchmark_script("report")


def _generate_row(impl, batch, tok_per_s, **extra):
    return {"what": "generate", "impl": impl, "batch": batch, "prompt": 512, "new": 256, "tok_per_s": tok_per_s,
            **extra}


E2E = {"gpu": "NVIDIA H200", "date": "2026-12-01T13:00:00+00:00", "copy_gbps": 4000.0, "rows": [
    _generate_row("fuselm.generate", 1, 230.0), _generate_row("eager", 1, 44.0),
    _generate_row("fuselm.generate", 32, 5000.0, bytes_per_step=16e9), _generate_row("eager", 32, 1000.0),
    {"what": "bound", "impl": "bound", "batch": 1, "prompt": 512, "new": 256, "tok_per_s": 287.0},
    {"what": "prefill", "impl": "eager", "batch": 1, "prompt": 2048, "new": 0, "ms": 60.9},
]}


def test_kernel_plots_one_png_per_family(report, tmp_path):
    results = json.loads((ROOT / "benchmarks" / "results" / "kernels-h200.json").read_text())
    written = report.kernel_plots(results, tmp_path)
    families = {row["kernel"] for row in results["rows"]}
    assert sorted(path.name for path in written) == sorted(f"kernels-{family}.png" for family in families)
    assert all(path.read_bytes().startswith(PNG) for path in written)


def test_decode_bound_from_a_bound_row_or_the_bytes_per_step(report):
    assert report._decode_bound(E2E, E2E["rows"], 1) == 287.0
    assert report._decode_bound(E2E, E2E["rows"], 32) == pytest.approx(32 * 4000e9 / 16e9)
    assert report._decode_bound(E2E, E2E["rows"], 8) is None


def test_decode_plot_from_the_generate_schema(report, tmp_path):
    path = report.decode_plot(E2E, tmp_path)
    assert path == tmp_path / report.DECODE_PLOT and path.read_bytes().startswith(PNG)


def test_old_e2e_schema_gets_a_line_and_no_plot(report, tmp_path, capsys):
    old = {"gpu": "NVIDIA H200", "rows": [{"what": "prefill B1×2048 (ms)", "unpatched": "60.9", "patched": "49.6"}]}
    assert report.decode_plot(old, tmp_path) is None
    assert "no decode plot" in capsys.readouterr().out and not any(tmp_path.iterdir())



def _step_row(what, impl, tokens, tok_per_s, peak_gib, checkpointing=False):
    return {"what": what, "impl": impl, "tokens": tokens, "checkpointing": checkpointing,
            "ms": tokens / tok_per_s * 1e3, "tok_per_s": tok_per_s, "peak_gib": peak_gib,
            "formula": "tok_per_s = tokens / median step s"}


TRAIN = {"gpu": "NVIDIA H200", "torch": "2", "transformers": "5", "peft": "0", "train_model": "tiny", "date": "d",
         "rows": [*E2E["rows"],
                  _step_row("lora_step", "unpatched", 4096, 8000.0, 50.0),
                  _step_row("lora_step", "fuselm", 4096, 15000.0, 30.0),
                  _step_row("lora_step", "liger", 4096, 9000.0, 40.0),
                  _step_row("lora_step", "fuselm", 8192, 14000.0, 70.0),
                  _step_row("lora_step", "unpatched", 4096, 7000.0, 20.0, checkpointing=True),
                  _step_row("qlora_step", "unpatched", 4096, 1000.0, 20.0),
                  _step_row("qlora_step", "fuselm", 4096, 1400.0, 19.0),
                  {"what": "lora_step", "impl": "liger", "tokens": 8192, "checkpointing": False,
                   "error": "out of memory"},
                  {"what": "qlora_step", "impl": "liger", "skipped": "liger_kernel is not installed"}]}


def test_train_step_table_per_tokens_and_checkpointing_with_the_targets(report):
    lines = report.train_step_section(TRAIN)
    table = {tuple(cell.strip() for cell in line.strip("|").split("|")[:3]): line for line in lines
             if line.startswith("| LoRA") or line.startswith("| QLoRA")}
    assert list(table) == [("LoRA", "4096", "no"), ("LoRA", "8192", "no"), ("LoRA", "4096", "yes"),
                           ("QLoRA", "4096", "no")]
    short = table["LoRA", "4096", "no"]
    assert "| 8000 tok/s, 50.0 GiB | 15000 tok/s, 30.0 GiB | 9000 tok/s, 40.0 GiB |" in short
    assert "| 1.88× tok/s, 0.60× memory |" in short and short.endswith("≥ 14000 tok/s, ≤ 36 GiB: yes |")
    assert "| — | 14000 tok/s, 70.0 GiB | error |" in table["LoRA", "8192", "no"]
    assert table["LoRA", "8192", "no"].endswith(": no |")  # 70 GiB > the 60 GiB target
    assert table["LoRA", "4096", "yes"].endswith("|  |  |")  # no unpatched/fuselm pair, no target
    assert table["QLoRA", "4096", "no"].endswith("≥ 1.3× unpatched, ≤ its GiB: yes |")
    assert "- LoRA Liger-Kernel at 8192 tokens: failed (out of memory)" in lines
    assert "- QLoRA Liger-Kernel: skipped (liger_kernel is not installed)" in lines


def test_train_step_cell_shows_the_host_time_where_measured(report):
    row = {**_step_row("lora_step", "fuselm", 4096, 16000.0, 30.0), "issue_ms": 240.4}  # a 256 ms step
    results = {**TRAIN, "rows": [row]}
    (line,) = [line for line in report.train_step_section(results) if line.startswith("| LoRA")]
    assert "| 16000 tok/s, 30.0 GiB, issue 240 of 256 ms |" in line


def test_generation_table_leaves_the_training_rows_out(report):
    generated = [_generate_row("fuselm.generate", 1, 230.0, copy_fraction=0.7, formula="f"),
                 _generate_row("eager", 1, 44.0, copy_fraction=0.1)]
    trained = [row for row in TRAIN["rows"] if row["what"] in report.TRAIN_STEPS]
    results = {**TRAIN, "triton": "3", "model": "m", "copy_gbps": 4000.0, "rows": generated + trained}
    header = next(line for line in report.generate_section(results) if line.startswith("| measurement"))
    assert header == "| measurement | fuselm.generate | eager |"


def test_decode_section_renders_the_prefill_layer_rows(report):
    results = {"gpu": "GPU", "torch": "t", "triton": "tr", "transformers": "tf", "date": "d", "copy_gbps": 4000.0,
               "formulas": {"copy_gbps": "c", "prefill_layer": "bound = GEMMs + SDPA + bytes / copy"},
               "rows": [{"what": "prefill_layer", "impl": impl, "batch": 1, "context": 2048, "us": us, "gemm_us": 40.0,
                         "sdpa_us": 5.0, "elementwise_bytes": 123, "bound_us": 46.0, "pct_of_bound": 46.0 / us * 100}
                        for impl, us in (("fuselm", 47.5), ("hf_eager", 60.0))]}
    lines = report.decode_section(results)
    assert "bound = GEMMs + SDPA + bytes / copy." in lines
    assert "| 2048 | fuselm | 47.5 | 40.0 | 5.0 | 123 | 46.0 | 96.8 |" in lines
    assert "| 2048 | hf_eager | 60.0 | 40.0 | 5.0 | 123 | 46.0 | 76.7 |" in lines


def test_decode_section_renders_the_back_to_back_layer_step_and_older_rows(report):
    """A layer-step row with the back-to-back (no L2 flush) and chained figures shows them; one from a run before them
    shows a dash there; a failed row says error."""
    step = {"what": "layer_step", "batch": 1, "context": 512, "bytes": 438, "kernels": 5, "bound_us": 103.8,
            "rel_err_vs_hf_eager": 0.001}
    results = {"gpu": "GPU", "torch": "t", "triton": "tr", "transformers": "tf", "date": "d", "copy_gbps": 4222.0,
               "copy_gbps_steady": 4301.0, "formulas": {"copy_gbps": "c", "layer_step": "bytes / copy"},
               "rows": [{**step, "impl": "fuselm", "us": 136.0, "pct_of_bound": 76.3, "us_steady": 121.0,
                         "pct_of_bound_steady": 84.2, "us_chained": 124.5, "pct_of_bound_chained": 83.4,
                         "us_chained_steady": 119.0, "pct_of_bound_chained_steady": 85.6},
                        {**step, "impl": "hf_eager", "us": 256.2, "pct_of_bound": 40.5},
                        {**step, "impl": "hf_compile", "error": "RuntimeError: x"}]}
    lines = report.decode_section(results)
    assert any("back to back, without the L2 flush: 4301 GB/s." in line for line in lines)
    chained = "| 124.5 (83.4) | 119.0 (85.6) |"
    assert f"| 1 × 512 | fuselm | 136.0 | 103.8 | 76.3 | 121.0 | 84.2 {chained} 5 | 438 | 0.001 |" in lines
    assert "| 1 × 512 | hf_eager | 256.2 | 103.8 | 40.5 | — | — | — | — | 5 | 438 | 0.001 |" in lines
    assert any(line.startswith("| 1 × 512 | hf_compile (RuntimeError: x) | error | error |") for line in lines)


def test_decode_section_renders_the_back_to_back_projection_figures_where_measured(report):
    projection = {"what": "projection", "name": "o", "m": 1, "impl": "fused", "us": 13.2, "gbps": 2540.0,
                  "pct_of_copy": 60.2, "bytes": 33554432}
    results = {"gpu": "GPU", "torch": "t", "triton": "tr", "transformers": "tf", "date": "d", "copy_gbps": 4222.0,
               "formulas": {"copy_gbps": "c", "projection": "bytes / us"},
               "rows": [{**projection, "us_steady": 10.5, "pct_of_copy_steady": 74.3}, {**projection, "m": 8}]}
    lines = report.decode_section(results)
    assert "| o | 1 | fused | 13.20 | 2540 | 60.2 | 10.50 | 74.3 | 33554432 |" in lines
    assert "| o | 8 | fused | 13.20 | 2540 | 60.2 | — | — | 33554432 |" in lines


def test_generation_table_shows_the_eager_prefill_where_measured(report):
    generated = [_generate_row("fuselm.generate", 1, 230.0, copy_fraction=0.7, formula="f"),
                 {"what": "prefill", "impl": "fuselm.generate", "batch": 1, "prompt": 2048, "new": 1, "ms": 45.0}]
    results = {**TRAIN, "triton": "3", "model": "m", "copy_gbps": 4000.0, "rows": generated}
    assert not any("new prompt length" in line or "replays" in line for line in report.generate_section(results))
    eager = {"what": "prefill_eager", "impl": "fuselm.generate", "batch": 1, "prompt": 2048, "new": 1, "ms": 52.0}
    lines = report.generate_section({**results, "rows": [*generated, eager]})
    assert "| time to first token B1×2048, a new prompt length (eager prefill), ms | 52.0 |" in lines
    assert "| time to first token B1×2048, ms | 45.0 |" in lines and "replays its captured prefill" in lines[-1]


def test_generation_table_shows_the_decode_steps_alone_where_measured(report):
    plain = _generate_row("fuselm.generate", 1, 230.0, copy_fraction=0.7, formula="f")
    split = {**_generate_row("fuselm.generate", 32, 4700.0, copy_fraction=0.6, formula="f"),
             "first_token_ms": 301.4, "decode_tok_per_s": 5712.3}
    results = {**TRAIN, "triton": "3", "model": "m", "copy_gbps": 4000.0, "rows": [plain]}
    assert not any("decode steps alone" in line for line in report.generate_section(results))
    lines = report.generate_section({**results, "rows": [plain, split]})
    assert "| B32: first token (prefill), ms / decode steps alone, tok/s | 301.4 / 5712 |" in lines
    assert not any(line.startswith("| B1: first token") for line in lines)
    assert "decode steps alone: batch × (new − 1)" in lines[-1]
