"""fuselm.patching.families.attention_facts says, per layer of every listed family, what HF's attention
computes: compared with what HF's attention modules hold, and with what their forwards pass to the
attention function (scaling, sliding window, soft-cap, the heads' shapes, the mask each layer gets)."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fuselm.patching.families import FAMILIES, attention_facts
from tests.models import LISTED, TINY_MODELS, tiny_config, tiny_model, token_ids

RECORDING = "fuselm_recording"
SEQ_LEN = 9  # longer than every sliding window below

# (tiny model, config overrides, each layer's sliding window as transformers 5.24's modeling files set it)
CASES = [
    ("llama2", {}, [None, None]),
    ("llama", {}, [None, None]),
    ("llama", {"attention_bias": True}, [None, None]),
    ("llama3.1", {}, [None, None]),
    ("mistral", {}, [6, 6]),  # every layer
    ("mistral", {"sliding_window": None}, [None, None]),
    ("qwen2", {}, [None, None]),  # use_sliding_window is off by default
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}, [None, 5]),
    ("qwen3", {}, [None, None]),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "attention_bias": True},
     [None, 4]),
    ("gemma", {}, [None, None]),
    ("gemma2", {}, [6, None]),  # alternating, sliding first
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"], "attn_logit_softcapping": None}, [None, 6]),
    ("gemma3", {}, [6, None]),
    ("gemma3", {"attn_logit_softcapping": 25.0, "query_pre_attn_scalar": 16, "layer_types": None,
                "sliding_window_pattern": 3, "num_hidden_layers": 3}, [6, 6, None]),
    ("gemma3", {"use_bidirectional_attention": True}, [4, None]),  # the window becomes 6 // 2 + 1, both ways
    ("phi3", {}, [None, None]),
    ("phi3", {"sliding_window": 6}, [6, 6]),
    ("olmo2", {}, [None, None]),
    ("olmo2", {"attention_bias": True}, [None, None]),
]


def _case_id(case):
    name, overrides, _ = case
    return "-".join([name, *(f"{key}={value}" for key, value in overrides.items())])


@pytest.fixture
def recorded_calls(monkeypatch):
    """Each call HF's attention modules make to the attention function: (module, q, k, mask, keywords)."""
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, query.shape, key.shape, attention_mask, dict(kwargs)))
        passed = {key: value for key, value in kwargs.items() if key not in ("sliding_window", "softcap")}
        return sdpa_attention_forward(module, query, key, value, attention_mask, **passed)  # the mask slides

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, RECORDING, recording)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, RECORDING, eager_mask)
    return calls


def allowed_keys(window, causal):
    """[SEQ_LEN, SEQ_LEN] bool: which key positions each query position sees, as AttentionFacts describes it."""
    i = torch.arange(SEQ_LEN)[:, None]
    j = torch.arange(SEQ_LEN)[None, :]
    allowed = (j <= i) if causal else torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool)
    if window is not None:
        allowed &= (j > i - window) & (causal or (j < i + window))
    return allowed


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attention_facts_match_hf_attention(case, recorded_calls):
    name, overrides, expected_windows = case
    model = tiny_model(name, device="cpu", **overrides)
    family, config = FAMILIES[TINY_MODELS[name].family], model.config
    model.config._attn_implementation = RECORDING
    with torch.no_grad():
        model(token_ids(seq_len=SEQ_LEN, device="cpu"), use_cache=False)
    layers = [layer.self_attn for layer in model.model.layers]
    assert [call[0] for call in recorded_calls] == layers
    windows = []
    for index, (attention, q_shape, k_shape, mask, kwargs) in enumerate(recorded_calls):
        facts = attention_facts(family, config, index)
        windows.append(facts.sliding_window)
        # what the module holds
        projections = [getattr(attention, name) for name in facts.projections]
        assert all(isinstance(p, torch.nn.Linear) for p in projections)
        assert [p.bias is not None for p in projections] == [facts.qkv_bias] * len(projections)
        assert (getattr(attention, facts.output).bias is not None) == facts.output_bias
        assert attention.scaling == pytest.approx(facts.scaling, rel=1e-12)
        assert attention.head_dim == facts.head_dim
        assert attention.is_causal == facts.causal
        assert getattr(attention, "sliding_window", facts.sliding_window) == facts.sliding_window
        if facts.qk_norm is None:
            assert not hasattr(attention, "q_norm") and not hasattr(attention, "k_norm")
        else:
            width = 1 if facts.qk_norm == "head" else facts.num_heads
            kv_width = 1 if facts.qk_norm == "head" else facts.num_kv_heads
            assert attention.q_norm.weight.shape == (width * facts.head_dim,)
            assert attention.k_norm.weight.shape == (kv_width * facts.head_dim,)
        # what its forward passes on
        assert q_shape == (2, facts.num_heads, SEQ_LEN, facts.head_dim)
        assert k_shape == (2, facts.num_kv_heads, SEQ_LEN, facts.head_dim)
        assert kwargs["scaling"] == pytest.approx(facts.scaling, rel=1e-12)
        assert kwargs.get("softcap") == facts.softcap
        assert kwargs.get("sliding_window") == facts.sliding_window
        allowed = mask[0, 0] == 0  # eager masks add 0 where a key is seen, the dtype's minimum where not
        assert torch.equal(allowed, allowed_keys(facts.sliding_window, facts.causal))
    assert windows == expected_windows


def test_the_cases_cover_every_fact():
    """Each fact takes each of its values in at least one case, and every listed family is a case."""
    assert {name for name, _, _ in CASES} == set(LISTED)
    seen = {}
    for name, overrides, _ in CASES:
        config = tiny_config(name, **overrides)
        for index in range(config.num_hidden_layers):
            facts = attention_facts(FAMILIES[TINY_MODELS[name].family], config, index)
            for key, value in vars(facts).items():
                seen.setdefault(key, set()).add(value is not None if key in ("softcap", "sliding_window") else value)
    assert seen["projections"] == {("q_proj", "k_proj", "v_proj"), ("qkv_proj",)}
    assert seen["qkv_bias"] == seen["output_bias"] == seen["causal"] == {True, False}
    assert seen["qk_norm"] == {None, "head", "projection"}
    assert seen["softcap"] == seen["sliding_window"] == {True, False}
    assert len(seen["scaling"]) > 2


def test_a_layer_outside_the_config_is_refused():
    config = tiny_config("llama")
    with pytest.raises(ValueError, match="layer_idx"):
        attention_facts(FAMILIES["llama"], config, 2)
