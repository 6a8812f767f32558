"""``fuselm profile`` and ``fuselm bench``: what is counted as a launch, the CPU table and JSON, the triton path's
counts (interpreter), one-line errors for bad arguments; on a GPU, the times and bounds."""

import json
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fuselm
from fuselm import cli, profiling
from fuselm.cli import main
from fuselm.ops import _common
from tests.conftest import HAS_CUDA
from tests.models import tiny_config

TINY = ["--layers", "2", "--steps", "1", "--prompt", "8"]
ROW_KEYS = {"phase", "impl", "launches_per_layer", "launches_outside_layers", "launches_per_step", "launches_by_kind",
            "top_launches"}
INTERPRETER = pytest.mark.skipif(not fuselm.backend.INTERPRETING, reason="needs Triton's interpreter")
GPU_ROW_KEYS = {"gpu_ms_by_kind", "busy_ms", "window_ms", "idle_share", "busy_us_per_layer", "bound"}


@pytest.fixture(autouse=True)
def _counting(monkeypatch):
    """Counting, not checking results: the NaN fill of every kernel output (conftest) would count as launches.
    A wide console (rich reads COLUMNS when a console is made): no wrapped lines to parse."""
    monkeypatch.setattr(_common, "poison_outputs", False)
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A local HF model directory holding only a config: a 2-layer Llama whose head_dim (64) decode attention runs."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_config("llama", head_dim=64, num_hidden_layers=2).save_pretrained(path)
    return str(path)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


# ----------------------------------------------------------------------------------------- what counts
def test_host_launches_count_innermost_computing_ops_only():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        product = torch.nn.functional.linear(a, b)  # aten::linear > aten::t, aten::matmul > aten::mm
        product.view(64).t()  # views: no kernel
        product.to(torch.float64)  # aten::to > aten::_to_copy > aten::empty_strided, aten::copy_
        product.to(torch.float32)  # no-op conversion
        torch.empty(3)
    launches = profiling.host_launches(prof.events())
    assert [(launch.name, launch.kind) for launch in launches] == [("aten::mm", "projections"),
                                                                  ("aten::copy_", "elementwise")]


@INTERPRETER
def test_each_triton_launch_in_the_interpreter_counts_once():
    x, weight = torch.randn(5, 48), torch.randn(48)
    with fuselm.use_backend("triton"):
        fuselm.rms_norm(x, weight, 1e-6)  # warm-up: autotuning runs outside the profile
        with profiling._named_interpreter_launches(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fuselm.rms_norm(x, weight, 1e-6)
    launches = profiling.host_launches(prof.events())
    assert [(launch.name, launch.kind) for launch in launches] == [("triton::_rms_norm_fwd_kernel", "norms")]


@pytest.mark.parametrize(("kernel", "op", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "aten::mm", "projections"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "aten::addmm", "projections"),
    ("_qkv_rope_kernel", "fuselm::qkv_rope", "projections"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "aten::mm", "projections"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "aten::_flash_attention_forward",
     "attention"),
    ("_combine_partials", "fuselm::decode_attention", "attention"),
    ("_rms_norm_fwd_kernel", "fuselm::add_rms_norm", "norms"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "aten::add",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "aten::mean", "elementwise"),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>",
     "aten::_log_softmax", "loss"),
    ("_cross_entropy_partials_kernel", "fuselm::linear_cross_entropy", "loss"),
    ("Memcpy DtoD (Device -> Device)", "aten::copy_", "other"),
])
def test_kernel_kinds(kernel, op, kind):
    assert profiling.classify(kernel, op) == kind


def test_busy_time_merges_overlapping_kernels():
    launches = [profiling.Launch("a", "other", 0.0, 10.0), profiling.Launch("b", "other", 5.0, 12.0),
                profiling.Launch("c", "other", 20.0, 25.0)]
    assert profiling.busy_and_window_us(launches) == (17.0, 25.0)


def _event(name, device_type, id_=0, linked=0, parent=None, span=(0.0, 0.0), annotation=False):
    return SimpleNamespace(name=name, device_type=device_type, id=id_, linked_correlation_id=linked, cpu_parent=parent,
                           time_range=SimpleNamespace(start=span[0], end=span[1]), is_user_annotation=annotation)


def test_device_launches_take_the_kind_of_the_op_that_launched_them():
    """A CUDA profile's kernels, linked to their CPU ops by correlation id (the fused op above an aten op wins);
    GPU-side user annotations are not kernels."""
    fused = _event("fuselm::add_rms_norm", DeviceType.CPU, id_=1)
    inner = _event("aten::empty", DeviceType.CPU, id_=2, parent=fused)
    mean = _event("aten::mean", DeviceType.CPU, id_=3)
    events = [fused, inner, mean,
              _event("void at::native::reduce_kernel<512>", DeviceType.CUDA, linked=3, span=(10.0, 14.0)),
              _event("_rms_norm_fwd_kernel", DeviceType.CUDA, linked=1, span=(15.0, 16.0)),
              _event("vectorized_elementwise_kernel<fill>", DeviceType.CUDA, linked=2, span=(16.0, 17.0)),
              _event("Memset (Device)", DeviceType.CUDA, linked=98, span=(18.0, 18.5)),
              _event("aten::mm", DeviceType.CPU, id_=99),
              _event("cudaLaunchKernel", DeviceType.CPU, id_=99, linked=7),  # a runtime call: ids of another counter
              _event("void at::native::vectorized_elementwise_kernel<copy>", DeviceType.CUDA, linked=99,
                     span=(19.0, 19.5)),
              _event("step", DeviceType.CUDA, span=(0.0, 20.0), annotation=True)]
    assert profiling.device_launches(events) == [
        profiling.Launch("void at::native::reduce_kernel<512>", "elementwise", 10.0, 14.0),
        profiling.Launch("_rms_norm_fwd_kernel", "norms", 15.0, 16.0),
        profiling.Launch("vectorized_elementwise_kernel<fill>", "norms", 16.0, 17.0),
        profiling.Launch("Memset (Device)", "other", 18.0, 18.5),
        profiling.Launch("void at::native::vectorized_elementwise_kernel<copy>", "projections", 19.0, 19.5)]


def test_gpu_rows_and_table_from_launches(tiny_dir):
    """The CUDA row and table, from made-up launches: 2 layers against 1, 2 steps."""
    def launches(per_layer, layers, steps):
        made, clock = [], 0.0
        for _ in range(steps):
            for kind in ["projections"] + ["elementwise"] * (per_layer * layers) + ["loss"]:
                made.append(profiling.Launch(kind, kind, clock, clock + 1.0))
                clock += 2.0  # as long idle as busy
        return profiling.Profiled(made, steps)

    row = profiling.summarise(launches(3, 2, 2), launches(3, 1, 2), 2, 1, cuda=True)
    assert (row["launches_per_layer"], row["launches_outside_layers"], row["launches_per_step"]) == (3, 2, 8)
    assert row["gpu_ms_by_kind"] == pytest.approx({**dict.fromkeys(profiling.KINDS, 0.0), "projections": 1e-3,
                                                   "elementwise": 6e-3, "loss": 1e-3})
    assert row["busy_ms"] == pytest.approx(8e-3) and row["busy_us_per_layer"] == pytest.approx(3.0)
    assert row["idle_share"] == pytest.approx(1 - 16 / 31)  # 16 µs busy from the first start to the last end
    model = profiling.build(*profiling.resolve(tiny_dir), 2, torch.device("cpu"), torch.float32)
    ceilings = {"copy_gbps": 1000.0, "gemm_tflops": 100.0}
    rows = [{**row, "phase": "decode", "impl": impl, "bound": profiling.bound(model, "decode", 1, 8, 2, 2, ceilings)}
            for impl in ("unpatched", "patched")]
    for r in rows:
        r["bound"]["pct_of_bound"] = 100 * r["bound"]["ms"] / r["window_ms"]
    console = Console(record=True, width=200)
    console.print(profiling.table({"ceilings": ceilings, "prompt": 8, "batch": 1, "layers": 2, "rows": rows}, "decode"))
    text = console.export_text()
    for label, _ in profiling.metrics(cuda=True):
        assert label in text


def test_a_gpu_profile_without_kernels_is_a_clear_error():
    """No GPU kernel recorded on CUDA (a failed profiler) gives no GPU figures, rather than a division by zero."""
    nothing = profiling.Profiled([], 2)
    with pytest.raises(RuntimeError, match="recorded no GPU kernel"):
        profiling.summarise(nothing, nothing, 2, 1, cuda=True)
    assert profiling.summarise(nothing, nothing, 2, 1, cuda=False)["launches_per_step"] == 0


def test_decode_bound_counts_every_weight_once_and_the_kv_cache(tiny_dir):
    model = profiling.build(*profiling.resolve(tiny_dir), 2, torch.device("cpu"), torch.float32)
    config = model.config
    batch, prompt, steps = 3, 8, 2
    bound = profiling.bound(model, "decode", batch, prompt, steps, 2, {"copy_gbps": 1.0})
    weights = sum(p.numel() for p in model.parameters()) - config.vocab_size * config.hidden_size  # no embedding
    context = prompt + profiling.WARMUP_STEPS + (steps + 1) / 2
    kv = 2 * 2 * batch * (context + 1) * config.num_key_value_heads * config.head_dim  # read + the new slot
    assert bound["amount"] == pytest.approx(4 * (weights + kv))  # fp32
    assert bound["ms"] == pytest.approx(bound["amount"] / 1e9 * 1e3)


@pytest.mark.parametrize("phase", ["prefill", "train"])
def test_flop_bound_counts_the_projections_causal_attention_and_the_lm_head(tiny_dir, phase):
    model = profiling.build(*profiling.resolve(tiny_dir), 2, torch.device("cpu"), torch.float32)
    config = model.config
    batch, prompt = 2, 8
    bound = profiling.bound(model, phase, batch, prompt, 1, 2, {"gemm_tflops": 1.0})
    layer_weights = sum(p.numel() for p in model.get_decoder().layers.parameters() if p.dim() == 2)
    pairs = 2 * prompt * (prompt + 1) // 2  # two layers
    logits_rows = batch if phase == "prefill" else batch * prompt
    forward = (2 * batch * prompt * layer_weights + 4 * batch * pairs * config.num_attention_heads * config.head_dim
               + 2 * logits_rows * config.hidden_size * config.vocab_size)
    assert bound["amount"] == (forward if phase == "prefill" else 3 * forward)


# ----------------------------------------------------------------------------------------- the command on CPU
def test_cpu_profile_prints_the_message_the_table_and_writes_the_json(tiny_dir, tmp_path, capsys):
    path = tmp_path / "profile.json"
    trace = tmp_path / "trace.json"
    assert main(["profile", tiny_dir, *TINY, "--device", "cpu", "--json", str(path), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    where = "device cpu" if HAS_CUDA else "no CUDA GPU"
    assert lines[0] == (f"{where}: counting on cpu the ops that would launch GPU kernels (PyTorch reference (cpu)); "
                        "no GPU times, bytes or bounds")
    assert "which is not fused" in out  # the reference path's note
    headers = [line for line in lines if line.startswith("┃")]
    assert len(headers) == 3  # one table per phase
    for header, phase in zip(headers, profiling.PHASES):
        assert header.replace("┃", " ").split() == [phase, "unpatched", "patched"]
    labels = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert labels == 3 * [label.strip() for label, _ in profiling.metrics(cuda=False)]

    result = json.loads(path.read_text())
    assert {"model", "config_from", "layers", "layers_compared", "device", "gpu", "dtype", "ops_path", "backend",
            "batch", "prompt", "steps", "torch", "date", "ceilings", "kinds", "rows", "method"} <= result.keys()
    assert (result["layers"], result["layers_compared"], result["gpu"], result["ceilings"]) == (2, 1, None, None)
    assert [(row["phase"], row["impl"]) for row in result["rows"]] == [
        (phase, impl) for impl in ("unpatched", "patched") for phase in profiling.PHASES]
    for row in result["rows"]:
        assert row.keys() == ROW_KEYS
        assert list(row["launches_by_kind"]) == list(profiling.KINDS)
        assert sum(row["launches_by_kind"].values()) == row["launches_per_step"] > 0
        assert row["launches_per_layer"] > 0
        assert row["launches_per_step"] == pytest.approx(2 * row["launches_per_layer"] + row["launches_outside_layers"])
    for phase in profiling.PHASES:
        for impl in ("unpatched", "patched"):
            events = json.loads((tmp_path / f"trace-{phase}-{impl}.json").read_text())["traceEvents"]
            assert any(event.get("name") == "aten::mm" for event in events)
    unpatched = {row["phase"]: row for row in result["rows"] if row["impl"] == "unpatched"}
    assert unpatched["train"]["launches_per_layer"] > unpatched["prefill"]["launches_per_layer"]  # + the backward


@INTERPRETER
def test_triton_path_launches_fewer_kernels_per_layer_than_unpatched(tiny_dir, capsys):
    """In the interpreter every Triton launch counts once (no aten op inside it does): the patched layers launch
    fewer kernels than HF's in every phase, and its decode step is at most five."""
    with fuselm.use_backend("triton"):
        result = profiling.run(tiny_dir, device=torch.device("cpu"), layers=2, steps=1, prompt=8)
    assert "Triton interpreter (cpu)" in capsys.readouterr().out.splitlines()[0]
    rows = {(row["phase"], row["impl"]): row for row in result["rows"]}
    for phase in profiling.PHASES:
        patched, unpatched = rows[phase, "patched"], rows[phase, "unpatched"]
        assert 0 < patched["launches_per_layer"] < unpatched["launches_per_layer"], phase
        assert any(top["name"].startswith("triton::") for top in patched["top_launches"])
        assert not any(top["name"].startswith("triton::") for top in unpatched["top_launches"])
    assert rows["decode", "patched"]["launches_per_layer"] <= 5  # qkv_rope, attention, o, gate/up, down
    assert rows["decode", "patched"]["launches_by_kind"]["attention"] == 2  # decode attention, once per layer


# ----------------------------------------------------------------------------------------- bad arguments
BAD_ARGUMENTS = {
    "no-such-model": "unknown model 'no-such-model': give a local Hugging Face model directory or one of "
                     + ", ".join(profiling.MODELS),
    # the list of choices after it is argparse's (quoted or not, by Python version)
    "llama-3-8b --phase decoding": "argument --phase: invalid choice: 'decoding' (choose from ",
    "llama-3-8b --batch 0": "argument --batch: must be at least 1, got 0",
    "llama-3-8b --layers 1": "argument --layers: must be at least 2, got 1",
    "llama-3-8b --layers 33": "--layers 33: llama-3-8b has 32 decoder layers",
    "llama-3-8b --steps 0": "argument --steps: must be at least 1, got 0",
    "llama-3-8b --prompt 8190": "--prompt 8190: with 6 decode steps it passes the model's max_position_embeddings 8192",
    "llama-3-8b --device mps": "argument --device: the profile runs on cpu or cuda, got 'mps'",
    "llama-3-8b --json /no/such/folder/out.json": "--json /no/such/folder/out.json: the folder /no/such/folder does "
                                                  "not exist",
}


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_bad_profile_argument_is_a_one_line_error(arguments, capsys):
    assert _exit_code(["profile", *arguments.split()]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"fuselm profile: error: {BAD_ARGUMENTS[arguments]}")
    if "--phase" in arguments:
        assert errors[0].endswith(")") and all(phase in errors[0] for phase in profiling.PHASES)
    else:
        assert errors[0] == f"fuselm profile: error: {BAD_ARGUMENTS[arguments]}"


def test_a_folder_without_config_is_a_one_line_error(tmp_path, capsys):
    assert _exit_code(["profile", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"fuselm profile: error: {str(tmp_path)!r} has no config.json:"
                                                        " not a Hugging Face model directory")


def test_every_profile_option_shows_help_and_default(capsys):
    assert _exit_code(["profile", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for option in ("--phase", "--batch", "--prompt", "--layers", "--steps", "--device", "--json", "--trace"):
        described = help_text.split(option, 2)[-1].split(" --")[0]
        assert "(default:" in described, (option, described)


@pytest.mark.parametrize("name", profiling.MODELS)
def test_every_built_in_config_builds(name):
    """Each table entry is a config transformers builds a causal LM of (on the meta device: no memory)."""
    config, weights = profiling.resolve(name)
    assert (config.model_type, weights) == (profiling.MODELS[name].model_type, None)
    model = profiling.build(config, weights, 2, torch.device("meta"), torch.bfloat16)
    assert len(model.get_decoder().layers) == 2 and model.config.num_hidden_layers == 2
    assert config.num_hidden_layers == profiling.MODELS[name].config["num_hidden_layers"]  # the table's untouched


# ----------------------------------------------------------------------------------------- bench
def test_bench_without_the_source_tree_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path / "benchmarks")
    assert _exit_code(["bench", "kernels"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"fuselm bench: error: {tmp_path / 'benchmarks' / 'kernel_bench.py'} is not here: "
                                    "the benchmarks live in fuselm's source tree (a git checkout), not in the "
                                    "installed package")


def test_bench_passes_its_arguments_to_the_script(capsys):
    assert main(["bench", "kernels", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Kernel benchmarks on one CUDA GPU" in out and "--only" in out


def test_bench_returns_the_scripts_exit_status(capsys):
    assert main(["bench", "kernels", "--no-such-option"]) == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_profile_times_kinds_and_bounds(tiny_dir, tmp_path):
    trace = tmp_path / "trace.json"
    result = profiling.run(tiny_dir, device=torch.device("cuda"), layers=2, steps=2, prompt=16,
                           json_path=tmp_path / "profile.json", trace=trace)
    assert result["gpu"] == torch.cuda.get_device_name() and result["ceilings"]["copy_gbps"] > 0
    rows = {(row["phase"], row["impl"]): row for row in result["rows"]}
    for (phase, impl), row in rows.items():
        assert row.keys() == ROW_KEYS | GPU_ROW_KEYS, (phase, impl)
        assert 0 < row["busy_ms"] <= row["window_ms"] and 0 <= row["idle_share"] < 1
        assert sum(row["gpu_ms_by_kind"].values()) >= row["busy_ms"] * 0.999  # overlapping kernels count twice
        assert row["gpu_ms_by_kind"]["projections"] > 0 and row["bound"]["ms"] > 0
        assert row["bound"]["what"] == ("bytes" if phase == "decode" else "flops")
        assert (tmp_path / f"trace-{phase}-{impl}.json").is_file()
    for phase in profiling.PHASES:
        assert rows[phase, "patched"]["launches_per_layer"] < rows[phase, "unpatched"]["launches_per_layer"], phase
    assert rows["decode", "patched"]["gpu_ms_by_kind"]["attention"] > 0
    assert json.loads((tmp_path / "profile.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))


@pytest.mark.skipif(HAS_CUDA, reason="the CPU message")
def test_default_device_without_cuda_is_cpu(tiny_dir, capsys):
    assert main(["profile", tiny_dir, *TINY, "--phase", "prefill"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA GPU: counting on cpu")
