"""Write BENCHMARKS.md from the committed GPU results (benchmarks/results/*.json).

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# "target met": fuselm's row reaches this share of the copy bandwidth measured in the same run (% of copy)
# and is faster than the better of torch.compile and Liger-Kernel
BANDWIDTH_TARGET = {"fwd": 90.0, "fwd+bwd": 80.0}


def _same_size(row: dict) -> str:
    if "same_size_copy_gbps" not in row:
        return "—"
    return f"{row['pct_same_size_copy']:.1f} (copy {row['same_size_copy_gbps']:.0f} GB/s)"


def kernel_section(results: dict) -> list[str]:
    lines = [
        "## Kernels",
        "",
        f"{results['gpu']}; torch {results['torch']}, triton {results['triton']}, transformers "
        f"{results.get('transformers')}, Liger-Kernel {results.get('liger') or 'not installed'}; {results['date']}.",
        f"Ceilings measured in the same run: copy **{results['copy_gbps']:.0f} GB/s** (bytes read + written), "
        f"bf16 GEMM 8192³ **{results['gemm_tflops']:.0f} TFLOP/s**. {results['method']}.",
        *[f"Re-run on {r['date']} for {', '.join(r['kernels'])} (copy {r['copy_gbps']:.0f} GB/s, GEMM "
          f"{r['gemm_tflops']:.0f} TFLOP/s in that run; % of copy uses that run's copy figure)."
          for r in results.get("reruns", [])],
        "",
        "% of same-size copy: a copy moving the row's bytes, timed under do_bench like the rows (its L2 flush "
        "leaves dirty lines for the next kernel to write back, a fixed cost that weighs on short kernels), against "
        "the row's time; the targets use the 1 GiB copy above.",
        "",
        "| kernel | pass | impl | GPU ms | GB/s | % of copy | % of same-size copy | vs best of compile/Liger "
        "| target met | call ms | bytes counted |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    rows = [r for r in results["rows"] if "gbps" in r]
    for row in rows:
        anchors = [r["ms"] for r in rows if (r["kernel"], r["pass"]) == (row["kernel"], row["pass"])
                   and r["impl"] in ("compile", "liger")]
        speedup = met = ""
        if row["impl"] == "fuselm" and anchors:
            speedup = f"{min(anchors) / row['ms']:.2f}×"
            ok = row["pct_copy"] >= BANDWIDTH_TARGET[row["pass"]] and row["ms"] < min(anchors)
            met = "yes" if ok else "no"
        lines.append(f"| {row['kernel']} | {row['pass']} | {row['impl']} | {row['ms']:.3f} | {row['gbps']:.0f} | "
                     f"{row['pct_copy']:.1f} | {_same_size(row)} | {speedup} | {met} | "
                     f"{row.get('call_ms', float('nan')):.3f} | {row['formula']} |")
    lines += [""] + [f"Note: {note}" for note in results.get("notes", [])]
    ce = [r for r in results["rows"] if r["kernel"] == "linear_cross_entropy"]
    if ce:
        lines += ["", "### Linear + cross-entropy, fwd+bwd (8192 tokens × 4096 hidden × 128256 vocab, bf16)", "",
                  "| impl | ms | TFLOP/s | time / 3 GEMMs | peak extra MB |", "|---|---:|---:|---:|---:|"]
        for row in ce:
            lines.append(f"| {row['impl']} | {row['ms']:.2f} | {row['tflops']:.0f} | {row.get('vs_gemms', 1.0):.2f} | "
                         f"{row.get('peak_mb', '—')} |")
        lines += ["", f"FLOPs counted: {ce[0]['formula']}. Peak extra memory: "
                  + next((r["formula"] for r in ce if "peak_mb" in r), "—") + "."]
    return lines


def e2e_section(results: dict) -> list[str]:
    lines = ["## End to end (patch)", "",
             f"{results['gpu']}; torch {results['torch']}, triton {results.get('triton')}, transformers "
             f"{results.get('transformers')}, peft {results.get('peft')}; {results['model']}; {results['date']}.", "",
             "| measurement | unpatched | fuselm.patch | ratio | Liger-Kernel |", "|---|---:|---:|---:|---:|"]
    for row in results["rows"]:
        lines.append(f"| {row['what']} | {row['unpatched']} | {row['patched']} | {row['ratio']} | "
                     f"{row.get('liger', '—')} |")
    return lines + ["", results.get("notes", "")]


GENERATE_IMPLS = ("fuselm.generate", "fuselm+hf_generate", "eager", "compile_static", "liger")


def generate_section(results: dict) -> list[str]:
    """The generation table of e2e-h200.json: tok/s (and share of copy bandwidth) per batch, time to first token,
    first call, kernels per layer."""
    rows = results["rows"]
    impls = [i for i in GENERATE_IMPLS if any(r["impl"] == i for r in rows)]

    def cell(what: str, impl: str, batch: int | None = None, prompt: int | None = None) -> str:
        for r in rows:
            if (r["what"], r["impl"]) == (what, impl) and batch in (None, r["batch"]) and prompt in (None, r["prompt"]):
                if what == "generate":
                    return f"{r['tok_per_s']:.0f} ({r['copy_fraction']:.0%})"
                return f"{r.get('ms', r.get('s', r.get('value'))):.1f}"
        return "—"

    lines = ["## Generation (`benchmarks/e2e.py`)", "",
             f"{results['gpu']}; torch {results['torch']}, triton {results['triton']}, transformers "
             f"{results['transformers']}; {results['model']}; copy {results['copy_gbps']:.0f} GB/s; {results['date']}.",
             "", "| measurement | " + " | ".join(impls) + " |", "|---|" + "---:|" * len(impls)]
    batches = sorted({r["batch"] for r in rows if r["what"] == "generate"})
    for batch in batches:
        lines.append(f"| generate B{batch}, tok/s (share of copy) | "
                     + " | ".join(cell("generate", i, batch) for i in impls) + " |")
    for prompt in sorted({r["prompt"] for r in rows if r["what"] == "prefill"}):
        lines.append(f"| time to first token B1×{prompt}, ms | "
                     + " | ".join(cell("prefill", i, 1, prompt) for i in impls) + " |")
    for batch in batches:
        lines.append(f"| first call B{batch}, s | " + " | ".join(cell("first_call_s", i, batch) for i in impls) + " |")
    for batch in sorted({r["batch"] for r in rows if r["what"] == "launches_per_layer"}):
        lines.append(f"| kernels per layer per decode step, B{batch} | "
                     + " | ".join(cell("launches_per_layer", i, batch) for i in impls) + " |")
    formula = next((r["formula"] for r in rows if r["what"] == "generate"), "")
    return lines + ["", f"Share of copy: bytes per step × steps/s over the copy bandwidth; {formula}. "
                    "tok/s = batch × new tokens / the median time of whole generate calls (prefill included). "
                    "Kernels per layer: (a 4-layer model's kernels − a 2-layer one's) / 2 in one eager decode step."]


def _layer_step_cell(row: dict, key: str, fmt: str) -> str:
    return "error" if "error" in row else format(row[key], fmt)


def decode_section(results: dict) -> list[str]:
    formulas = results["formulas"]
    lines = ["## Decode", "",
             (f"{results['gpu']}; torch {results['torch']}, triton {results['triton']}, transformers "
              f"{results['transformers']}; {results['date']}. Copy bandwidth measured in the same run: "
              f"**{results['copy_gbps']:.0f} GB/s** ({formulas['copy_gbps']})."), ""]
    rows = results["rows"]
    steps = [r for r in rows if r["what"] == "layer_step"]
    if steps:
        lines += ["### Decoder layer decode step (Llama-3-8B shapes, bf16, one new token per row)", "",
                  f"{formulas['layer_step']}.", "",
                  "| B × context | impl | µs | bound µs | % of bound | kernels | bytes | rel. err vs hf_eager |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in steps:
            error = f" ({r['error']})" if "error" in r else ""
            lines.append(f"| {r['batch']} × {r['context']} | {r['impl']}{error} | {_layer_step_cell(r, 'us', '.1f')} "
                         f"| {_layer_step_cell(r, 'bound_us', '.1f')} | {_layer_step_cell(r, 'pct_of_bound', '.1f')} | "
                         f"{r.get('kernels', '—')} | {r['bytes']} | {r.get('rel_err_vs_hf_eager', '—')} |")
        lines.append("")
    attention = [r for r in rows if r["what"] == "attention"]
    if attention:
        lines += ["### Decode attention (Hq 32, Hkv 8, D 128, T = 1, bf16)", "", f"{formulas['attention']}.", "",
                  "| B × L | valid | impl | µs | GB/s | % of copy | rel. err vs fuselm |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} × {r['context']} | {r['valid']} | {r['impl']} | {r['us']:.2f} | {r['gbps']:.0f} | "
                  f"{r['pct_of_copy']:.1f} | {r['rel_err_vs_fuselm']} |" for r in attention]
        lines.append("")
    projections = [r for r in rows if r["what"] == "projection"]
    if projections:
        lines += ["### Decode projections (M = B rows, T = 1, bf16)", "", f"{formulas['projection']}.", "",
                  "| projection | M | impl | µs | GB/s | % of copy | bytes |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['m']} | {r['impl']} | {r['us']:.2f} | {r['gbps']:.0f} | {r['pct_of_copy']:.1f} "
                  f"| {r['bytes']} |" for r in projections]
    return lines


def main() -> None:
    out = ["# Benchmarks", "", "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`, which "
           "`bash benchmarks/gpu_run.sh` writes on the GPU machine. Medians of CUDA-event timings after warm-up.", ""]
    kernels = RESULTS / "kernels-h200.json"
    if kernels.exists():
        out += kernel_section(json.loads(kernels.read_text())) + [""]
    train = RESULTS / "train-h200.json"
    if train.exists():
        out += e2e_section(json.loads(train.read_text())) + [""]
    generation = RESULTS / "e2e-h200.json"
    if generation.exists():
        out += generate_section(json.loads(generation.read_text())) + [""]
    decode = RESULTS / "decode-h200.json"
    if decode.exists():
        out += decode_section(json.loads(decode.read_text())) + [""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(out))


if __name__ == "__main__":
    main()
