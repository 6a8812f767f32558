"""Write BENCHMARKS.md from the committed GPU results (benchmarks/results/*.json), and draw its plots.

    python benchmarks/report.py

The plots (PNG, benchmarks/plots/, committed) need matplotlib (``pip install 'fuselm[bench]'``); without it the
committed ones stay and BENCHMARKS.md links them. Per kernel family, from kernels-h200.json: each implementation's
achieved GB/s (TFLOP/s for linear_cross_entropy) against the ceilings measured in the same run. From e2e-h200.json,
rows ``{"what": "generate", "impl", "batch", "prompt", "new", "tok_per_s"}``: greedy decode tok/s per impl, against
the bound where the file gives one (rows ``{"what": "bound", "batch", "tok_per_s"}``, or ``bound_tok_per_s`` or
``bytes_per_step`` with the top-level ``copy_gbps`` on a generate row); rows ``{"what": "lora_step" | "qlora_step",
"impl", "tokens", "checkpointing", "tok_per_s", "peak_gib"}`` (or ``skipped`` / ``error``): the fine-tuning table.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "benchmarks" / "plots"
MEMORY_BOUND = ("rms_norm", "add_rms_norm", "rope", "swiglu")  # kernel families plotted in GB/s
IMPL_ORDER = ("fuselm", "eager", "compile", "liger")
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


def _run_dates(rows: list[dict]) -> str:
    """When the rows were measured: one run, or (a file merged from several, e2e.py --merge-into) each run's impls."""
    runs: dict[str, list[str]] = {}
    for row in rows:
        impls = runs.setdefault(row.get("run_date", "undated"), [])
        if row["impl"] not in impls:
            impls.append(row["impl"])
    if len(runs) == 1:
        return f"run {next(iter(runs))}"
    return "runs " + "; ".join(f"{date}: {', '.join(impls)}" for date, impls in sorted(runs.items()))


GENERATE_IMPLS = ("fuselm.generate", "fuselm+hf_generate", "eager", "compile_static", "liger")


def generate_section(results: dict) -> list[str]:
    """The generation table of e2e-h200.json: tok/s (and share of copy bandwidth) per batch, time to first token,
    first call, kernels per layer."""
    rows = [r for r in results["rows"] if r["what"] not in TRAIN_STEPS]
    impls = [i for i in GENERATE_IMPLS if any(r["impl"] == i for r in rows)]

    def cell(what: str, impl: str, batch: int | None = None, prompt: int | None = None) -> str:
        for r in rows:
            if what == "decode" and (r["what"], r["impl"], r["batch"]) == ("generate", impl, batch):
                if "decode_tok_per_s" in r:
                    return f"{r['first_token_ms']:.1f} / {r['decode_tok_per_s']:.0f}"
            elif ((r["what"], r["impl"]) == (what, impl) and batch in (None, r["batch"])
                  and prompt in (None, r["prompt"])):
                if what == "generate":
                    return f"{r['tok_per_s']:.0f} ({r['copy_fraction']:.0%})"
                return f"{r.get('ms', r.get('s', r.get('value'))):.1f}"
        return "—"

    lines = ["## Generation (`benchmarks/e2e.py`)", "",
             f"{results['gpu']}; torch {results['torch']}, triton {results['triton']}, transformers "
             f"{results['transformers']}; {results['model']}; copy {results['copy_gbps']:.0f} GB/s (latest run)"
             f"; {_run_dates(rows)}.",
             "", "| measurement | " + " | ".join(impls) + " |", "|---|" + "---:|" * len(impls)]
    batches = sorted({r["batch"] for r in rows if r["what"] == "generate"})
    for batch in batches:
        lines.append(f"| generate B{batch}, tok/s (share of copy) | "
                     + " | ".join(cell("generate", i, batch) for i in impls) + " |")
    for batch in sorted({r["batch"] for r in rows if r["what"] == "generate" and "decode_tok_per_s" in r}):
        lines.append(f"| B{batch}: first token (prefill), ms / decode steps alone, tok/s | "
                     + " | ".join(cell("decode", i, batch) for i in impls) + " |")
    for prompt in sorted({r["prompt"] for r in rows if r["what"] == "prefill"}):
        lines.append(f"| time to first token B1×{prompt}, ms | "
                     + " | ".join(cell("prefill", i, 1, prompt) for i in impls) + " |")
    for prompt in sorted({r["prompt"] for r in rows if r["what"] == "prefill_after_idle"}):
        lines.append(f"| time to first token B1×{prompt}, after the GPU idled, ms | "
                     + " | ".join(cell("prefill_after_idle", i, 1, prompt) for i in impls) + " |")
    for prompt in sorted({r["prompt"] for r in rows if r["what"] == "prefill_eager"}):
        lines.append(f"| time to first token B1×{prompt}, a new prompt length (eager prefill), ms | "
                     + " | ".join(cell("prefill_eager", i, 1, prompt) for i in impls) + " |")
    for batch in batches:
        lines.append(f"| first call B{batch}, s | " + " | ".join(cell("first_call_s", i, batch) for i in impls) + " |")
    for batch in sorted({r["batch"] for r in rows if r["what"] == "launches_per_layer"}):
        lines.append(f"| kernels per layer per decode step, B{batch} | "
                     + " | ".join(cell("launches_per_layer", i, batch) for i in impls) + " |")
    formula = next((r["formula"] for r in rows if r["what"] == "generate"), "")
    return lines + ["", f"Share of copy: bytes per step × steps/s over the copy bandwidth; {formula}. "
                    "tok/s = batch × new tokens / the median time of whole generate calls (prefill included). "
                    + ("First token: the same prompt's call with one new token; decode steps alone: batch × (new − 1) "
                       "/ (call time − first token). " if any("decode_tok_per_s" in r for r in rows) else "")
                    + ("Time to first token: one prompt length called again and again (fuselm replays its captured "
                       "prefill from the third call, up to 4096 tokens); a new length's first call prefills eagerly. "
                       if any(r["what"] == "prefill_eager" for r in rows) else "")
                    + (f"After the GPU idled: the same call, each after {idle[0]['idle_s']:g} s with the GPU idle, the "
                       "median of single calls; the rows above it run back to back, on a GPU whose power cap may have "
                       "lowered its clocks. " if (idle := [r for r in rows if r["what"] == "prefill_after_idle"])
                       else "") +
                    "Kernels per layer: (a 4-layer model's kernels − a 2-layer one's) / 2 in one eager decode step. "
                    f"First calls: Triton cache {results.get('triton_cache', 'as found')}; fuselm's tuning table "
                    f"{results.get('tuning_table', 'none (before tables)')}."] + [
        line for note in results.get("notes", []) for line in ("", f"Note: {note}")]


TRAIN_STEPS = {"lora_step": "LoRA", "qlora_step": "QLoRA"}
TRAIN_IMPLS = {"unpatched": "unpatched", "fuselm": "fuselm.patch", "liger": "Liger-Kernel"}
# issue 15's targets on one H200, steps without gradient checkpointing: (tokens) -> (min tok/s, max GiB)
LORA_TARGETS = {4096: (14000, 36), 8192: (13000, 60)}
QLORA_SPEEDUP = 1.3  # QLoRA: fuselm at >= 1.3x the unpatched tok/s, at <= its peak memory


def _step_cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if "tok_per_s" not in row:
        return "error" if "error" in row else "skipped"
    issue = f", issue {row['issue_ms']:.0f} of {row['ms']:.0f} ms" if "issue_ms" in row else ""
    return f"{row['tok_per_s']:.0f} tok/s, {row['peak_gib']:.1f} GiB{issue}"


def _step_target(what: str, tokens: int, fused: dict | None, base: dict | None) -> str:
    """The issue's target for a step without checkpointing, and whether fuselm's row meets it; "" where none."""
    if fused is None or "tok_per_s" not in fused:
        return ""
    if what == "lora_step" and tokens in LORA_TARGETS:
        rate, memory = LORA_TARGETS[tokens]
        met = fused["tok_per_s"] >= rate and fused["peak_gib"] <= memory
        return f"≥ {rate} tok/s, ≤ {memory} GiB: {'yes' if met else 'no'}"
    if what == "qlora_step" and base is not None and "tok_per_s" in base:
        met = fused["tok_per_s"] >= QLORA_SPEEDUP * base["tok_per_s"] and fused["peak_gib"] <= base["peak_gib"]
        return f"≥ {QLORA_SPEEDUP}× unpatched, ≤ its GiB: {'yes' if met else 'no'}"
    return ""


def train_step_section(results: dict) -> list[str]:
    """The lora_step / qlora_step rows of e2e-h200.json: tok/s and peak GiB per impl, fuselm against unpatched, the
    issue's targets; rows that were skipped or failed, with the reason, under the table."""
    rows = [r for r in results["rows"] if r["what"] in TRAIN_STEPS]
    measured = [r for r in rows if "tokens" in r]
    shapes = sorted({(r["what"], r["checkpointing"], r["tokens"]) for r in measured},
                    key=lambda shape: (list(TRAIN_STEPS).index(shape[0]), shape[1], shape[2]))
    lines = ["## Fine-tuning step (`benchmarks/e2e.py`)", "",
             f"{results['gpu']}; torch {results['torch']}, transformers {results['transformers']}, peft "
             f"{results.get('peft')}; {results.get('train_model')}; {_run_dates(rows)}.", "",
             "| step | tokens | checkpointing | " + " | ".join(TRAIN_IMPLS.values())
             + " | fuselm.patch / unpatched | target (issue 15) |",
             "|---|---:|---|" + "---:|" * len(TRAIN_IMPLS) + "---:|---|"]
    for what, checkpointing, tokens in shapes:
        found = {r["impl"]: r for r in measured
                 if (r["what"], r["checkpointing"], r["tokens"]) == (what, checkpointing, tokens)}
        fused, base = found.get("fuselm"), found.get("unpatched")
        ratio = ""
        if fused and base and "tok_per_s" in fused and "tok_per_s" in base:
            ratio = (f"{fused['tok_per_s'] / base['tok_per_s']:.2f}× tok/s, "
                     f"{fused['peak_gib'] / base['peak_gib']:.2f}× memory")
        target = "" if checkpointing else _step_target(what, tokens, fused, base)
        lines.append(f"| {TRAIN_STEPS[what]} | {tokens} | {'yes' if checkpointing else 'no'} | "
                     + " | ".join(_step_cell(found.get(impl)) for impl in TRAIN_IMPLS) + f" | {ratio} | {target} |")
    formula = next((r["formula"] for r in measured if "formula" in r), None)
    lines += ["", f"{formula}; each impl in its own process."] if formula else []
    lines += [f"Note: {note}" for note in results.get("train_notes", [])]
    for row in rows:
        reason = row.get("skipped") or row.get("error")
        if reason:
            where = f" at {row['tokens']} tokens" if "tokens" in row else ""
            kind = "skipped" if "skipped" in row else "failed"
            lines.append(f"- {TRAIN_STEPS[row['what']]} {TRAIN_IMPLS.get(row['impl'], row['impl'])}{where}: "
                         f"{kind} ({reason})")
    return lines


def lora_profile_section(results: dict, title: str) -> list[str]:
    """One LoRA (or QLoRA) AdamW step per variant: time, tok/s, peak memory and GPU ms by kind of kernel."""
    runs = results["runs"]
    kinds = list(dict.fromkeys(kind for run in runs for kind in run["ms_by_kind"]))
    lines = [f"## {title} (`benchmarks/lora_profile.py`)", "",
             f"{results['gpu']}; torch {results['torch']}, transformers {results['transformers']}, peft "
             f"{results['peft']}; {results['model']}; {results['tokens']} tokens; {results['date']}.", "",
             "| | " + " | ".join(run["variant"] for run in runs) + " |", "|---|" + "---:|" * len(runs)]
    lines.append("| step ms (median) | " + " | ".join(f"{run['step_ms']:.1f}" for run in runs) + " |")
    lines.append("| tok/s | " + " | ".join(f"{run['tok_per_s']:.0f}" for run in runs) + " |")
    lines.append("| peak GiB | " + " | ".join(f"{run['peak_gib']:.1f}" for run in runs) + " |")
    for kind in kinds:
        lines.append(f"| GPU ms: {kind} | " + " | ".join(f"{run['ms_by_kind'].get(kind, 0.0):.1f}" for run in runs)
                     + " |")
    lines.append("| GPU ms profiled | " + " | ".join(f"{run['profiled_ms']:.1f}" for run in runs) + " |")
    if all("host" in run for run in runs):  # lora_profile.py --host
        lines.append("| host: kernel launches | " + " | ".join(f"{run['host']['kernel_launches']}" for run in runs)
                     + " |")
        lines.append("| host: ms to issue a step | " + " | ".join(f"{run['host']['issue_ms']:.1f}" for run in runs)
                     + " |")
    lines += [""] + [f"Note: {note}" for note in results.get("notes", [])]
    return lines + ["", f"The frozen base's GEMMs: {results['base_gemm_tflop']:.1f} TFLOP = "
                    f"{results['base_gemm_flop_time_ms']:.1f} ms at the {results['bf16_gemm_tflops_measured']:.0f} "
                    "TFLOP/s measured in the same run (4 · tokens · Σ K·N over the projections and the lm_head)."]


def _layer_step_cell(row: dict, key: str, fmt: str) -> str:
    """A decode row's figure: "error" for a failed row, "—" for one a run before the figure existed lacks."""
    return "error" if "error" in row else "—" if row.get(key) is None else format(row[key], fmt)


def decode_section(results: dict) -> list[str]:
    formulas = results["formulas"]
    lines = ["## Decode", "",
             (f"{results['gpu']}; torch {results['torch']}, triton {results['triton']}, transformers "
              f"{results['transformers']}; fuselm {results.get('fuselm_commit')}; {results['date']}. Copy bandwidth "
              f"measured in the same run: **{results['copy_gbps']:.0f} GB/s** ({formulas['copy_gbps']})"
              + (f"; back to back, without the L2 flush: {results['copy_gbps_steady']:.0f} GB/s."
                 if results.get("copy_gbps_steady") else ".")), ""]
    lines += [f"Note: {note}" for note in results.get("notes", [])] + ([""] if results.get("notes") else [])
    rows = results["rows"]
    steps = [r for r in rows if r["what"] == "layer_step"]
    if steps:
        lines += ["### Decoder layer decode step (Llama-3-8B shapes, bf16, one new token per row)", "",
                  f"{formulas['layer_step']}.", "",
                  "| B × context | impl | µs | bound µs | % of bound | µs back to back | % of bound back to back "
                  "| chained: µs (% of bound) | chained, back to back: µs (%) | kernels | bytes "
                  "| rel. err vs hf_eager |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in steps:
            error = f" ({r['error']})" if "error" in r else ""
            figures = " | ".join(_layer_step_cell(r, key, ".1f")
                                 for key in ("us", "bound_us", "pct_of_bound", "us_steady", "pct_of_bound_steady"))
            for us, pct in (("us_chained", "pct_of_bound_chained"),
                            ("us_chained_steady", "pct_of_bound_chained_steady")):
                cell = _layer_step_cell(r, us, ".1f")
                figures += f" | {cell} ({r[pct]:.1f})" if r.get(us) is not None and "error" not in r else f" | {cell}"
            lines.append(f"| {r['batch']} × {r['context']} | {r['impl']}{error} | {figures} | {r.get('kernels', '—')} "
                         f"| {r['bytes']} | {r.get('rel_err_vs_hf_eager', '—')} |")
        lines.append("")
    attention = [r for r in rows if r["what"] == "attention"]
    if attention:
        lines += ["### Decode attention (Hq 32, Hkv 8, D 128, T = 1, bf16)", "", f"{formulas['attention']}.", "",
                  "| B × L | valid | impl | µs | GB/s | % of copy | rel. err vs fuselm |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} × {r['context']} | {r['valid']} | {r['impl']} | {r['us']:.2f} | {r['gbps']:.0f} | "
                  f"{r['pct_of_copy']:.1f} | {r['rel_err_vs_fuselm']} |" for r in attention]
        lines.append("")
    prefills = [r for r in rows if r["what"] == "prefill_layer"]
    if prefills:
        lines += ["### Decoder layer prefill (Llama-3-8B shapes, bf16, B = 1, no cache)", "",
                  f"{formulas['prefill_layer']}.", "",
                  "| T | impl | µs | GEMMs µs | SDPA µs | elementwise bytes | bound µs | % of bound |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['context']} | {r['impl']} | {r['us']:.1f} | {r['gemm_us']:.1f} | {r['sdpa_us']:.1f} | "
                  f"{r['elementwise_bytes']} | {r['bound_us']:.1f} | {r['pct_of_bound']:.1f} |" for r in prefills]
        lines.append("")
    projections = [r for r in rows if r["what"] == "projection"]
    if projections:
        lines += ["### Decode projections (M = B rows, T = 1, bf16)", "", f"{formulas['projection']}.", "",
                  "| projection | M | impl | µs | GB/s | % of copy | µs back to back | % of copy back to back "
                  "| bytes |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['m']} | {r['impl']} | {r['us']:.2f} | {r['gbps']:.0f} | {r['pct_of_copy']:.1f} "
                  f"| {_layer_step_cell(r, 'us_steady', '.2f')} | {_layer_step_cell(r, 'pct_of_copy_steady', '.1f')} "
                  f"| {r['bytes']} |" for r in projections]
    return lines


def kernel_plot_path(plots: Path, kernel: str) -> Path:
    return plots / f"kernels-{kernel}.png"


DECODE_PLOT = "decode-tok-s.png"


def _impl_color(impl: str) -> str:
    """fuselm red (its variants orange), the anchors each their colour (the cuBLAS or bound reference purple)."""
    if impl.startswith("fuselm"):
        return "tab:red" if impl in ("fuselm", "fuselm.generate") else "tab:orange"
    for anchor, color in (("eager", "tab:gray"), ("compile", "tab:blue"), ("liger", "tab:green")):
        if impl.startswith(anchor):
            return color
    return "tab:purple"


def _bars(axes, labels: list[str], values: list[float], x: float, width: float, texts: list[str], top: float):
    """Bars side by side around ``x``, each with its text: inside its top, or above a short bar."""
    for index, (label, value, text) in enumerate(zip(labels, values, texts)):
        position = x + (index - (len(values) - 1) / 2) * width
        axes.bar(position, value, width * 0.9, color=_impl_color(label), label=label)
        inside = value > 0.15 * top
        axes.annotate(text, (position, value), ha="center", va="top" if inside else "bottom", fontsize=7,
                      color="white" if inside else "black", xytext=(0, -3 if inside else 2), textcoords="offset points")


def _legend_below(axes, columns: int) -> None:
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1),
                ncol=columns, frameon=False)


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: the file changes with the data only


def _copy_ceiling(results: dict, kernel: str) -> tuple[float, str]:
    """The copy bandwidth a kernel's % of copy uses: its re-run's, else the main run's; with the run's date."""
    for rerun in results.get("reruns", []):
        if kernel in rerun["kernels"]:
            return rerun["copy_gbps"], rerun["date"]
    return results["copy_gbps"], results["date"]


def kernel_plots(results: dict, plots: Path) -> list[Path]:
    """One PNG per kernel family: achieved GB/s of each implementation per pass, fuselm first, against the 1 GiB
    copy ceiling (line) and the same-size copy (marks); linear_cross_entropy in TFLOP/s against the bf16 GEMM."""
    import matplotlib.pyplot as plt

    written = []
    rows = results["rows"]
    for kernel in MEMORY_BOUND:
        mine = [r for r in rows if r["kernel"] == kernel and "gbps" in r]
        if not mine:
            continue
        ceiling, date = _copy_ceiling(results, kernel)
        figure, axes = plt.subplots(figsize=(6.4, 3.6))
        passes = list(dict.fromkeys(r["pass"] for r in mine))
        for x, pass_ in enumerate(passes):
            group = sorted((r for r in mine if r["pass"] == pass_),
                           key=lambda r: IMPL_ORDER.index(r["impl"]) if r["impl"] in IMPL_ORDER else len(IMPL_ORDER))
            _bars(axes, [r["impl"] for r in group], [r["gbps"] for r in group], x, 0.2,
                  [f"{100 * r['gbps'] / ceiling:.0f}%" for r in group], ceiling)
            same_size = group[0].get("same_size_copy_gbps")
            if same_size:
                axes.hlines(same_size, x - 0.45, x + 0.45, colors="black", linestyles="dotted",
                            label="copy of the same bytes" if x == 0 else None)
        axes.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"1 GiB copy {ceiling:.0f} GB/s")
        axes.set_xticks(range(len(passes)), passes)
        axes.set_ylabel("achieved GB/s (bytes counted / time)")
        axes.set_ylim(0, ceiling * 1.1)
        axes.set_title(f"{kernel} on {results['gpu']} ({date[:10]}): % of the copy ceiling", fontsize=10)
        _legend_below(axes, 3)
        path = kernel_plot_path(plots, kernel)
        _save(figure, path)
        plt.close(figure)
        written.append(path)
    ce = [r for r in rows if r["kernel"] == "linear_cross_entropy" and "tflops" in r]
    if ce:
        figure, axes = plt.subplots(figsize=(6.4, 3.6))
        ceiling = results["gemm_tflops"]
        _bars(axes, [r["impl"] for r in ce], [r["tflops"] for r in ce], 0, 1.0,
              [f"{100 * r['tflops'] / ceiling:.0f}%" for r in ce], ceiling)
        axes.axhline(ceiling, color="black", linestyle="--", linewidth=1,
                     label=f"bf16 GEMM 8192³ {ceiling:.0f} TFLOP/s")
        axes.set_xticks([index - (len(ce) - 1) / 2 for index in range(len(ce))],
                        [r["impl"].replace(", ", ",\n") for r in ce], fontsize=7)
        axes.set_ylabel("TFLOP/s (3 · 2·N·H·V / time)")
        axes.set_ylim(0, ceiling * 1.1)
        axes.set_title(f"linear_cross_entropy fwd+bwd on {results['gpu']} ({results['date'][:10]}): "
                       "% of the GEMM ceiling", fontsize=10)
        axes.legend([axes.lines[-1]], [axes.lines[-1].get_label()], fontsize=7, loc="lower right")
        path = kernel_plot_path(plots, "linear_cross_entropy")
        _save(figure, path)
        plt.close(figure)
        written.append(path)
    return written


def _decode_bound(results: dict, rows: list[dict], batch: int) -> float | None:
    """Bound tok/s at ``batch``: a ``bound`` row, else a generate row's ``bound_tok_per_s`` or ``bytes_per_step``."""
    for row in rows:
        if row["what"] == "bound" and row.get("batch") == batch and "tok_per_s" in row:
            return row["tok_per_s"]
    for row in rows:
        if row["what"] == "generate" and row["batch"] == batch:
            if "bound_tok_per_s" in row:
                return row["bound_tok_per_s"]
            if "bytes_per_step" in row and "copy_gbps" in results:
                return batch * results["copy_gbps"] * 1e9 / row["bytes_per_step"]
    return None


def decode_plot(results: dict, plots: Path) -> Path | None:
    """Greedy decode tok/s per impl, one panel per (batch, prompt, new), against the bound; None (and a printed
    line) when the file has no rows of the generate schema."""
    rows = results.get("rows", [])
    generate = [r for r in rows if isinstance(r, dict) and r.get("what") == "generate"
                and {"impl", "batch", "prompt", "new", "tok_per_s"} <= r.keys()]
    if not generate:
        print("e2e-h200.json has no rows {what: generate, impl, batch, prompt, new, tok_per_s} (the old schema?): "
              "no decode plot")
        return None
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["batch"], r["prompt"], r["new"]) for r in generate))
    figure, panels = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes) + 1, 3.8), squeeze=False)
    for axes, (batch, prompt, new) in zip(panels[0], shapes):
        group = [r for r in generate if (r["batch"], r["prompt"], r["new"]) == (batch, prompt, new)]
        bound = _decode_bound(results, rows, batch)
        top = max([r["tok_per_s"] for r in group] + [bound or 0])
        _bars(axes, [r["impl"] for r in group], [r["tok_per_s"] for r in group], 0, 0.8 / len(group),
              [f"{r['tok_per_s']:.0f}" for r in group], top)
        if bound:
            axes.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"bound {bound:.0f} tok/s")
        axes.set_xticks([])
        axes.set_ylim(0, top * 1.1)
        axes.set_title(f"batch {batch}, prompt {prompt}, {new} new", fontsize=9)
        _legend_below(axes, 2)
    panels[0][0].set_ylabel("greedy decode tok/s")
    figure.suptitle(f"Decode on {results.get('gpu', '?')} ({str(results.get('date', ''))[:10]})", fontsize=10)
    path = plots / DECODE_PLOT
    _save(figure, path)
    plt.close(figure)
    return path


def draw_plots(results_dir: Path = RESULTS, plots: Path = PLOTS) -> list[Path]:
    """Redraw every plot the results allow; [] with a printed line where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'fuselm[bench]'): the plots are not redrawn")
        return []
    matplotlib.use("Agg")
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    kernels, e2e = results_dir / "kernels-h200.json", results_dir / "e2e-h200.json"
    if kernels.exists():
        written += kernel_plots(json.loads(kernels.read_text()), plots)
    if e2e.exists():
        written += filter(None, [decode_plot(json.loads(e2e.read_text()), plots)])
    return written


def plot_links(paths: list[Path], alt: str) -> list[str]:
    """Markdown images for the plots that exist (committed), relative to the repository root."""
    return [f"![{alt}: {path.stem}]({path.relative_to(ROOT).as_posix()})" for path in paths if path.exists()]


def main() -> None:
    out = ["# Benchmarks", "", "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`, which "
           "`bash benchmarks/gpu_run.sh` writes on the GPU machine. Medians of CUDA-event timings after warm-up.", ""]
    kernels = RESULTS / "kernels-h200.json"
    draw_plots()
    if kernels.exists():
        out += kernel_section(json.loads(kernels.read_text())) + [""]
        families = [kernel_plot_path(PLOTS, kernel) for kernel in (*MEMORY_BOUND, "linear_cross_entropy")]
        links = plot_links(families, "kernel")
        if links:
            out += ["### Plots: achieved bandwidth against the copy ceiling", "", *links, ""]
    train = RESULTS / "train-h200.json"
    if train.exists():
        out += e2e_section(json.loads(train.read_text())) + [""]
    generation = RESULTS / "e2e-h200.json"
    e2e = json.loads(generation.read_text()) if generation.exists() else {"rows": []}
    if any(row["what"] not in TRAIN_STEPS for row in e2e["rows"]):
        out += generate_section(e2e) + [""]
        links = plot_links([PLOTS / DECODE_PLOT], "decode")
        if links:
            out += [*links, ""]
    if any(row["what"] in TRAIN_STEPS for row in e2e["rows"]):
        out += train_step_section(e2e) + [""]
    for name, title in (("lora-profile-h200.json", "LoRA step"), ("qlora-profile-h200.json", "QLoRA step"),
                        ("lora-host-3aba5bb-h200.json", "LoRA step, host view, before session 5's launch cuts"),
                        ("lora-host-e28c4ac-h200.json", "LoRA step, host view, before lora_linear"),
                        ("lora-host-h200.json", "LoRA step, host view"),
                        ("qlora-host-3aba5bb-h200.json", "QLoRA step, host view, before session 5's launch cuts"),
                        ("qlora-host-before-scales-h200.json", "QLoRA step, host view, scales dequantised per call"),
                        ("qlora-host-h200.json", "QLoRA step, host view")):
        profile = RESULTS / name
        if profile.exists():
            out += lora_profile_section(json.loads(profile.read_text()), title) + [""]
    decode = RESULTS / "decode-h200.json"
    if decode.exists():
        out += decode_section(json.loads(decode.read_text())) + [""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(out))


if __name__ == "__main__":
    main()
