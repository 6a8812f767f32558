"""Shared op machinery: the direct eager path computes what the torch.library op computes; loops
over runtime bounds run under the interpreter with any numpy."""

import json
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

import fuselm
from fuselm.backend import INTERPRETING
from fuselm.ops import _common
from fuselm.ops.glu import GLU
from fuselm.ops.rms_norm import ADD_RMS_NORM
from fuselm.ops.rope import ROPE_INPLACE
from tests.helpers import grads, randn


@triton.jit
def _strided_count_kernel(out_ptr, end, step):
    # One program: counts the iterations of a loop whose start, end and step are all runtime values.
    count = 0
    for _ in range(tl.program_id(0) + 1, end, step):
        count += 1
    tl.store(out_ptr + tl.program_id(0), count)


def test_loops_over_runtime_bounds_convert_them_without_numpy_warnings(device):
    """triton < 3.7's interpreter converted loop bounds with int(1-element array): a DeprecationWarning
    with numpy < 2.4, a TypeError from numpy 2.4 on (fuselm/ops/_common.py works around it)."""
    if device != "cpu" or not INTERPRETING:
        pytest.skip("checks Triton's CPU interpreter")
    out = torch.full((2,), -1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _strided_count_kernel[(2,)](out, 12, 3)
    assert out.tolist() == [len(range(1, 12, 3)), len(range(2, 12, 3))]


def test_direct_eager_path_equals_the_torch_library_op(device):
    x, r = randn(5, 40, device=device, requires_grad=True), randn(5, 40, device=device, requires_grad=True)
    w = (1 + 0.1 * randn(40, device=device)).requires_grad_()
    with fuselm.use_backend("triton"):
        direct = ADD_RMS_NORM(x, r, w, 1e-6, 0.0, "llama")
        library = ADD_RMS_NORM.op(x, r, w, 1e-6, 0.0, "llama")
        assert type(direct[0].grad_fn) is not type(library[0].grad_fn)  # two routes, really taken
        for a, b in zip(direct, library):
            assert torch.equal(a, b)
        seed = [torch.randn_like(direct[0]), torch.randn_like(direct[1])]
        for a, b in zip(grads(direct[:2], (x, r, w), seed), grads(library[:2], (x, r, w), seed)):
            assert torch.equal(a, b)


def test_no_grad_calls_skip_autograd(device):
    gate, up = randn(3, 16, device=device, requires_grad=True), randn(3, 16, device=device)
    with fuselm.use_backend("triton"), torch.no_grad():
        out = GLU(gate, up, "silu")
    assert out.grad_fn is None and not out.requires_grad


def test_in_place_op_bumps_version_counters(device):
    q, k = randn(1, 2, 3, 8, device=device), randn(1, 1, 3, 8, device=device)
    cos, sin = randn(1, 3, 8, device=device), randn(1, 3, 8, device=device)
    before = q._version, k._version
    with fuselm.use_backend("triton"):
        fuselm.rope(q, k, cos, sin, inplace=True)
    assert q._version > before[0] and k._version > before[1]


def test_in_place_op_goes_direct_with_torch_librarys_result_and_versions(device):
    """An op that writes into its arguments skips torch.library's dispatch when nothing needs a gradient, with the
    same result and the same version-counter bumps; with an input needing one, torch.library's route is kept."""
    q, k = randn(1, 2, 3, 8, device=device), randn(1, 1, 3, 8, device=device)
    cos, sin = randn(1, 3, 8, device=device), randn(1, 3, 8, device=device)
    library_q, library_k = q.clone(), k.clone()
    with fuselm.use_backend("triton"):
        ROPE_INPLACE.op(library_q, library_k, cos, sin, "bhsd")
        versions = q._version, k._version, cos._version
        with mock.patch.object(ROPE_INPLACE, "op", side_effect=AssertionError("torch.library was called")):
            ROPE_INPLACE(q, k, cos, sin, "bhsd")
        assert torch.equal(q, library_q) and torch.equal(k, library_k)
        assert (q._version, k._version, cos._version) == (versions[0] + 1, versions[1] + 1, versions[2])
        cos.requires_grad_()
        with mock.patch.object(ROPE_INPLACE, "op") as library:
            ROPE_INPLACE(q, k, cos, sin, "bhsd")
        library.assert_called_once()


@triton.jit
def _launch_key_kernel(x_ptr, y_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    # Never launched: the tests below stand a recorder in for its run.
    pass


class _RunRecorder:
    """Stands in for a JIT function's ``run``: records each launch's config meta-parameter."""

    def __init__(self):
        self.blocks = []

    def run(self, *args, grid, warmup, **kwargs):
        self.blocks.append(kwargs["BLOCK"])


def _recording_tuner(pre_hook=None):
    configs = [triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64}, pre_hook=pre_hook)]
    tuner = triton.autotune(configs, key=["n", "FLAG"])(_launch_key_kernel)
    recorder = tuner.fn = _RunRecorder()
    return tuner, recorder


def test_launch_key_is_the_key_triton_looks_up():
    """Triton's own ``Autotuner.run`` finds, without tuning, the config filed under ``launch_key``'s key: positional
    and keyword arguments, constexprs and dtypes in triton's order."""
    tuner, recorder = _recording_tuner()
    args = (torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32), 7)
    kwargs = {"scale": 0.5, "FLAG": True, "grid": (1,), "warmup": False}
    key = _common.launch_key(tuner, frozenset(tuner.arg_names), args, kwargs)
    assert key == (7, True, "torch.bfloat16", "torch.int32")
    tuner.cache[key] = tuner.configs[1]
    tuner.prune_configs = mock.Mock(side_effect=AssertionError("triton's run looked up another key and tuned"))
    type(tuner).run(tuner, *args, **kwargs)
    assert recorder.blocks == [64]


def test_a_tuned_key_launches_directly_and_a_new_one_takes_tritons_path():
    tuner, recorder = _recording_tuner()
    tuner.run = tritons = mock.Mock()
    _common.launching_tuned_configs_directly(tuner)
    args, kwargs = (torch.zeros(3), torch.zeros(3), 7, 0.5), {"FLAG": False}
    tuner.cache[_common.launch_key(tuner, frozenset(tuner.arg_names), args, kwargs)] = tuner.configs[1]
    tuner[(1,)](*args, **kwargs)
    assert recorder.blocks == [64] and tuner.best_config is tuner.configs[1] and not tritons.called
    tuner[(1,)](torch.zeros(3), torch.zeros(3), 9, 0.5, FLAG=False)  # key n = 9: not tuned yet
    tritons.assert_called_once()
    assert recorder.blocks == [64]


def test_a_config_with_a_pre_hook_takes_tritons_path():
    tuner, recorder = _recording_tuner(pre_hook=lambda nargs: None)
    tuner.run = tritons = mock.Mock()
    _common.launching_tuned_configs_directly(tuner)
    args, kwargs = (torch.zeros(3), torch.zeros(3), 7, 0.5), {"FLAG": False}
    tuner.cache[_common.launch_key(tuner, frozenset(tuner.arg_names), args, kwargs)] = tuner.configs[1]
    tuner[(1,)](*args, **kwargs)
    tritons.assert_called_once()
    assert recorder.blocks == []


class _FakeTuner:
    """What compiling_in_parallel uses of a triton Autotuner: prune_configs, nargs (set by its run), fn.run."""

    def __init__(self, configs, failing=()):
        self.configs, self.failing = configs, failing
        self.nargs = {"x_ptr": "x", "n": 7}
        self.compiled = []  # (config kwargs, warmup, whether an AsyncCompileMode was active)
        self.fn = self

    def prune_configs(self, kwargs):
        return self.configs[1:]  # as an early_config_prune might

    def run(self, *args, grid, warmup, **kwargs):
        from triton.runtime import _async_compile

        assert args == ("x", 7) and grid == "grid"
        self.compiled.append(({k: kwargs[k] for k in ("BLOCK", "num_warps")}, warmup,
                              _async_compile.active_mode.get() is not None))
        if kwargs["BLOCK"] in self.failing:
            raise RuntimeError("this config does not compile")


def test_a_new_autotuning_key_compiles_its_pruned_configs_in_parallel_first(monkeypatch):
    """Each pruned config's launch runs once as a warm-up (compile only) under triton's AsyncCompileMode, a config that
    fails to compile is skipped (its timing run meets it), and the pruned configs come back unchanged; with
    parallel_compile off, or one config left, nothing is compiled ahead."""
    pytest.importorskip("triton.runtime._async_compile")
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 4), (32, 4), (64, 8), (128, 8))]
    tuner = _common.compiling_in_parallel(_FakeTuner(configs, failing=(64,)))
    launch = {"grid": "grid", "warmup": False, "HAS_BIAS": True}
    assert tuner.prune_configs(launch) == configs[1:]
    assert sorted(tuner.compiled, key=lambda c: c[0]["BLOCK"]) == [
        ({"BLOCK": b, "num_warps": w}, True, True) for b, w in ((32, 4), (64, 8), (128, 8))]
    assert launch["warmup"] is False  # the caller's launch arguments are not modified
    monkeypatch.setattr(_common, "parallel_compile", False)
    tuner.compiled.clear()
    assert tuner.prune_configs(launch) == configs[1:] and tuner.compiled == []
    monkeypatch.setattr(_common, "parallel_compile", True)
    single = _common.compiling_in_parallel(_FakeTuner(configs[:2]))
    assert single.prune_configs(launch) == configs[1:2] and single.compiled == []


def test_autotune_picks_lists_each_tuned_key_as_json():
    """One entry per key an autotuner has tuned, its key's values (dtypes as strings) and the chosen config's
    meta-parameters, warps and stages; nothing for an autotuner that has tuned nothing."""
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": 256}, num_warps=4, num_stages=3) for n in (16, 32)]

    def tuner(name, cache):
        return SimpleNamespace(fn=SimpleNamespace(__name__=name), cache=cache, configs=configs)

    picks = _common.autotune_picks([tuner("_linear_kernel", {(1, 4096, torch.bfloat16): configs[1],
                                                              (32, 4096, torch.bfloat16): configs[0]}),
                                    tuner("_untuned_kernel", {})])
    assert picks == [
        {"kernel": "_linear_kernel", "key": [1, 4096, "torch.bfloat16"],
         "config": {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}, "of": 2, "from_table": False},
        {"kernel": "_linear_kernel", "key": [32, 4096, "torch.bfloat16"],
         "config": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}, "of": 2, "from_table": False}]
    assert json.loads(json.dumps(picks)) == picks


@pytest.mark.gpu
def test_autotune_picks_records_a_gpu_kernels_tuned_key():
    """On a GPU, a fused op's call tunes its kernel (here or in an earlier test), and the pick is listed."""
    x = torch.randn(3, 1000, device="cuda")
    fuselm.rms_norm(x, torch.randn(x.shape[1], device="cuda"))
    picks = _common.autotune_picks()
    assert any("rms_norm" in pick["kernel"] for pick in picks), sorted({pick["kernel"] for pick in picks})
    assert all(set(pick) == {"kernel", "key", "config", "of", "from_table"} and pick["of"] >= 1 for pick in picks)


@pytest.mark.gpu
def test_a_shipped_tuning_table_entry_is_used_on_its_gpu():
    """On a GPU with a shipped table, an op whose key the table holds launches the table's config untimed."""
    device = torch.device("cuda", torch.cuda.current_device())
    table = _common._tuning_table(_common.device_name(device))
    # x, weight, bias (the weight stands in), residual, out in bf16, the split-K partials fp32, the tickets int32
    entry = ("_linear_residual_kernel",
             json.dumps([16, 4096, 4096] + ["torch.bfloat16"] * 5 + ["torch.float32", "torch.int32"]))
    if entry not in table:
        pytest.skip(f"no shipped table entry for {entry} on {_common.device_name(device)}")
    x, residual = (randn(1, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    weight = randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    with fuselm.use_backend("triton"):
        out = fuselm.linear_residual(x, weight, residual)
    expected = residual.double() + x.double() @ weight.double().t()
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2
    pick = next(p for p in _common.autotune_picks() if (p["kernel"], json.dumps(p["key"])) == entry)
    assert pick["from_table"] and pick["config"] == table[entry]


class _TableTuner(_FakeTuner):
    """A fake Autotuner of kernel ``_table_test_kernel`` keyed on ``n`` (and x's dtype), launched on 'cuda:0'."""

    def __init__(self, configs, n):
        super().__init__(configs)
        self.fn = self
        self.__name__ = "_table_test_kernel"
        self.keys, self.arg_names = ["n"], ["x_ptr", "n"]
        self.nargs = {"x_ptr": torch.empty(2), "n": n}
        self.cache = {}

    def run(self, *args, grid, warmup, **kwargs):
        self.compiled.append(kwargs["BLOCK"])


def _forget_tables():
    for cached in (_common._table_file, _common._tuning_table, _common.tuning_settings):
        cached.cache_clear()


def test_a_tuning_table_entry_keeps_only_its_config(monkeypatch, tmp_path):
    """A key the launch's GPU's table holds keeps the table's config alone (nothing compiled ahead, nothing to time)
    when the pruned list has it; another key, a config pruned away, another GPU or the table off: all pruned configs.
    autotune_picks says which picks came from the table."""
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=3) for b in (16, 32, 64)]
    table = {"gpu": "Test GPU 9", "picks": [
        {"kernel": "_table_test_kernel", "key": [7, "torch.float32"], "config": {"BLOCK": 32, "num_warps": 4,
                                                                                  "num_stages": 3}},
        {"kernel": "_table_test_kernel", "key": [8, "torch.float32"], "config": {"BLOCK": 16, "num_warps": 4,
                                                                                  "num_stages": 3}}]}
    monkeypatch.setattr(_common, "TUNING_DIR", tmp_path)
    (tmp_path / "test-gpu-9.json").write_text(json.dumps(table))
    monkeypatch.setattr(_common, "launch_device", lambda tuner: torch.device("cuda", 0))
    monkeypatch.setattr(_common, "device_name", lambda device: "Test GPU 9")
    _forget_tables()
    launch = {"grid": "grid", "warmup": False}
    hit = _common.compiling_in_parallel(_TableTuner(configs, 7))
    assert hit.prune_configs(launch) == [configs[1]] and hit.compiled == []
    hit.cache[(7, "torch.float32")] = configs[1]
    assert _common.autotune_picks([hit])[0]["from_table"]
    pruned_away = _common.compiling_in_parallel(_TableTuner(configs, 8))  # the table's BLOCK 16 is pruned
    assert pruned_away.prune_configs(launch) == configs[1:]
    assert _common.compiling_in_parallel(_TableTuner(configs, 9)).prune_configs(launch) == configs[1:]
    monkeypatch.setattr(_common, "use_tuning_table", False)
    assert _common.compiling_in_parallel(_TableTuner(configs, 7)).prune_configs(launch) == configs[1:]
    monkeypatch.setattr(_common, "use_tuning_table", True)
    monkeypatch.setattr(_common, "device_name", lambda device: "Another GPU")
    assert _common.compiling_in_parallel(_TableTuner(configs, 7)).prune_configs(launch) == configs[1:]
    _forget_tables()


def _autotuners() -> dict[str, list]:
    """Every autotuned fuselm kernel's name and its autotuners (under the interpreter, its one-config stand-ins;
    either has ``configs``, ``keys`` and ``arg_names``)."""
    import fuselm.ops.attention
    import fuselm.ops.cross_entropy
    import fuselm.ops.decode_linear
    import fuselm.ops.glu
    import fuselm.ops.rms_norm
    import fuselm.ops.rope  # noqa: F401

    tuners = {}
    for module in [m for name, m in vars(fuselm.ops).items() if not name.startswith("_") or name == "_common"]:
        for value in vars(module).values():
            if hasattr(value, "configs") and hasattr(value, "fn"):
                fn = value
                while hasattr(fn, "fn"):
                    fn = fn.fn
                tuners.setdefault(fn.__name__, []).append(value)
    return tuners


def _autotuned_kernels() -> dict[str, list]:
    """Every autotuned fuselm kernel's name and configs (the union over its autotuners)."""
    return {name: [config for tuner in tuners for config in tuner.configs] for name, tuners in _autotuners().items()}


def test_the_shipped_tuning_tables_name_configs_their_kernels_have():
    """Each pick of each shipped table is a config its kernel still lists (a table left behind by a change to a
    config list would only ever miss, silently: this says so). And the names are what tuning_table_path gives."""
    kernels = _autotuned_kernels()
    assert {"_linear_residual_kernel", "_qkv_rope_kernel", "_norm_gated_kernel"} <= set(kernels)
    tables = sorted(_common.TUNING_DIR.glob("*.json"))
    assert tables, "no shipped tuning table"
    for path in tables:
        table = json.loads(path.read_text())
        assert _common.tuning_table_path(table["gpu"]) == path
        for pick in table["picks"]:
            listed = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                      for c in kernels[pick["kernel"]]]
            assert pick["config"] in listed, (path.name, pick)


def test_the_shipped_tuning_tables_keys_fit_their_kernels_arguments():
    """A pick's key is the kernel's key arguments, then one dtype per tensor argument (launch_key; fuselm names
    every tensor argument *_ptr): a kernel that gains or loses a tensor argument leaves every key of its table
    behind, and the GPU would tune at run time instead (19faf7f's two new pointers did, caught on an H100)."""
    tuners = _autotuners()
    for path in sorted(_common.TUNING_DIR.glob("*.json")):
        for pick in json.loads(path.read_text())["picks"]:
            fits = [len(pick["key"]) == len(tuner.keys) + sum(name.endswith("_ptr") for name in tuner.arg_names)
                    and all(str(value).startswith("torch.") for value in pick["key"][len(tuner.keys):])
                    for tuner in tuners[pick["kernel"]]]
            assert any(fits), (path.name, pick["kernel"], pick["key"])


def test_dependent_launch_is_off_on_the_cpu_and_in_the_interpreter():
    cpu = torch.device("cpu")
    assert _common.dependent_launch(cpu, 1, op="qkv_rope") == {"DEPENDENT": False, "PREFETCH_LINES": 0}
    assert _common.dependent_launch(cpu, 1, op="decode_attention", prefetch=False) == {"DEPENDENT": False}


def test_dependent_launch_names_a_bad_op():
    with pytest.raises(ValueError, match="op must be one of .*'o_proj'"):
        _common.dependent_launch(torch.device("cpu"), 1, op="o_proj")


def test_dependent_launch_is_on_for_few_rows_where_the_gpu_supports_it(monkeypatch):
    """The launch keywords as a supporting GPU gets them (the GPU and the interpreter check stood in for)."""
    monkeypatch.setattr(_common, "INTERPRETING", False)
    monkeypatch.setattr(_common, "_supports_dependent_launch", lambda device: True)
    monkeypatch.setattr(_common, "dependent_max_rows_override", {})
    monkeypatch.setattr(_common, "device_name", lambda device: "GPU without a table")
    monkeypatch.setattr(_common, "weight_prefetch_bytes", 512)
    cuda, op = torch.device("cuda", 0), "linear_residual"
    assert _common.dependent_launch(cuda, 1, op=op) == {"DEPENDENT": True, "launch_pdl": True, "PREFETCH_LINES": 4}
    assert _common.dependent_launch(cuda, _common.DEPENDENT_MAX_ROWS, op=op, prefetch=False) == {
        "DEPENDENT": True, "launch_pdl": True}
    assert _common.dependent_launch(cuda, _common.DEPENDENT_MAX_ROWS + 1, op=op)["DEPENDENT"] is False
    assert _common.dependent_launch(cuda, 0, op=op)["DEPENDENT"] is False
    monkeypatch.setattr(_common, "weight_prefetch_bytes", 0)
    assert _common.dependent_launch(cuda, 1, op=op)["PREFETCH_LINES"] == 0
    monkeypatch.setattr(_common, "use_dependent_launch", False)
    assert _common.dependent_launch(cuda, 1, op=op) == {"DEPENDENT": False, "PREFETCH_LINES": 0}


@pytest.mark.gpu
def test_a_chain_of_dependent_launches_replayed_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    """Each linear_residual reads the one before's output: launched dependently (each waits for the one before) in a
    replayed graph, with new inputs, the result equals the same chain launched plainly."""
    weights = [randn(512, 512, dtype=torch.bfloat16, device="cuda") / 16 for _ in range(4)]
    x = randn(1, 512, dtype=torch.bfloat16, device="cuda")

    def chain(h):
        for weight in weights:
            h = fuselm.linear_residual(h, weight, h)
        return h

    with fuselm.use_backend("triton"):
        chain(x)  # tunes every key before the capture
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            static_out = chain(static_x)
        for _ in range(3):
            static_x.copy_(randn(1, 512, dtype=torch.bfloat16, device="cuda"))
            graph.replay()
            monkeypatch.setattr(_common, "use_dependent_launch", False)
            expected = chain(static_x)
            monkeypatch.setattr(_common, "use_dependent_launch", True)
            torch.cuda.synchronize()
            assert torch.isfinite(static_out).all()
            assert torch.equal(static_out, expected)


def test_the_dependent_row_limit_is_the_gpus_tuning_setting_unless_the_environment_sets_one(monkeypatch, tmp_path):
    """A table's ``dependent_max_rows`` setting bounds the dependent launches on its GPU, on with the table's config
    picks off too; a GPU without one gets DEPENDENT_MAX_ROWS; FUSELM_DEPENDENT_MAX_ROWS (read at import) wins."""
    monkeypatch.setattr(_common, "INTERPRETING", False)
    monkeypatch.setattr(_common, "_supports_dependent_launch", lambda device: True)
    monkeypatch.setattr(_common, "dependent_max_rows_override", {})
    monkeypatch.setattr(_common, "TUNING_DIR", tmp_path)
    (tmp_path / "test-gpu-9.json").write_text(json.dumps({"gpu": "Test GPU 9", "picks": [], "settings": {
        "dependent_max_rows": {"value": 8, "source": "results.json"},
        "dependent_max_rows.decode_attention": {"value": 32, "source": "ab.json"}}}))
    names = {0: "Test GPU 9", 1: "GPU without a table"}
    monkeypatch.setattr(_common, "device_name", lambda device: names[device.index])
    _forget_tables()
    tabled, untabled = torch.device("cuda", 0), torch.device("cuda", 1)

    def dependent(device, rows, op="qkv_rope"):
        return _common.dependent_launch(device, rows, op=op)["DEPENDENT"]

    assert _common.tuning_settings("Test GPU 9") == {"dependent_max_rows": 8, "dependent_max_rows.decode_attention": 32}
    assert dependent(tabled, 8) and not dependent(tabled, 9)
    assert dependent(tabled, 32, "decode_attention") and not dependent(tabled, 33, "decode_attention")
    monkeypatch.setattr(_common, "use_tuning_table", False)
    assert not dependent(tabled, 9)
    assert dependent(untabled, _common.DEPENDENT_MAX_ROWS) and not dependent(untabled, _common.DEPENDENT_MAX_ROWS + 1)
    monkeypatch.setattr(_common, "dependent_max_rows_override", {None: 16})
    assert dependent(tabled, 16) and dependent(tabled, 16, "decode_attention") and not dependent(tabled, 17)
    assert not dependent(untabled, 17)
    monkeypatch.setattr(_common, "dependent_max_rows_override", {None: 32, "linear_residual": 8})
    assert dependent(tabled, 32) and dependent(tabled, 32, "decode_attention")
    assert dependent(tabled, 8, "linear_residual") and not dependent(tabled, 9, "linear_residual")
    monkeypatch.setattr(_common, "dependent_max_rows_override", {"norm_gated_linear": 1})
    assert dependent(tabled, 8) and not dependent(tabled, 9) and dependent(untabled, _common.DEPENDENT_MAX_ROWS)
    assert not dependent(untabled, 2, "norm_gated_linear")
    _forget_tables()


def test_dependent_settings_say_which_launches_are_dependent(monkeypatch):
    """What a benchmark records: off without CUDA or with FUSELM_DEPENDENT_LAUNCH=0; else each op's row limit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _common.dependent_settings() == {"dependent_launch": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "_supports_dependent_launch", lambda device: True)
    monkeypatch.setattr(_common, "device_name", lambda device: "GPU without a table")
    monkeypatch.setattr(_common, "dependent_max_rows_override", {"qkv_rope": 16})
    limits = dict.fromkeys(_common.DEPENDENT_OPS, _common.DEPENDENT_MAX_ROWS) | {"qkv_rope": 16}
    assert _common.dependent_settings() == {"dependent_launch": True, "dependent_max_rows": limits}
    monkeypatch.setattr(_common, "use_dependent_launch", False)
    assert _common.dependent_settings() == {"dependent_launch": False}


@pytest.mark.parametrize(("text", "limits"), [("", {}), (" 8 ", {None: 8}),
                                              ("32, decode_attention=8", {None: 32, "decode_attention": 8}),
                                              ("qkv_rope=0,linear_residual=1", {"qkv_rope": 0, "linear_residual": 1})])
def test_the_dependent_row_override_reads_a_limit_for_all_ops_and_per_op(text, limits):
    assert _common._dependent_rows_override(text) == limits


@pytest.mark.parametrize(("text", "match"), [("eight", "comma list of N and op=N"), ("-1", "got '-1'"),
                                             ("8,o_proj=2", "unknown op 'o_proj'.*the ops are qkv_rope"),
                                             ("qkv_rope=", "got 'qkv_rope='")])
def test_a_bad_dependent_row_override_names_the_variable(text, match):
    with pytest.raises(ValueError, match=f"FUSELM_DEPENDENT_MAX_ROWS.*{match}"):
        _common._dependent_rows_override(text)


def test_the_h200_table_sets_its_dependent_row_limit():
    """The H200's measured limit ships with its table (session 30: 8 rows, B32's generate 4880 vs 4724 tok/s)."""
    assert _common.tuning_settings("NVIDIA H200") == {"dependent_max_rows": 8}


def test_integer_environment_settings_read_or_name_themselves_when_bad(monkeypatch):
    monkeypatch.delenv("FUSELM_WEIGHT_PREFETCH", raising=False)
    assert _common._env_count("FUSELM_WEIGHT_PREFETCH", 512) == 512
    monkeypatch.setenv("FUSELM_WEIGHT_PREFETCH", " 256 ")
    assert _common._env_count("FUSELM_WEIGHT_PREFETCH", 512) == 256
    for bad in ("eight", "-1", "2.5"):
        monkeypatch.setenv("FUSELM_WEIGHT_PREFETCH", bad)
        with pytest.raises(ValueError, match="FUSELM_WEIGHT_PREFETCH must be a non-negative integer"):
            _common._env_count("FUSELM_WEIGHT_PREFETCH", 512)
