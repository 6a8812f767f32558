"""fuselm.generate and a patched model's generate against HF's generate on the same unpatched model.

Greedy tokens and logits for every family with fused layers on both paths (left padding, rows of different
lengths, more new tokens than the prompt, sliding-window prompts longer than the window, eos inside the batch);
HF's logits processors and warpers on the loop's own logits; seeded sampling; the streamer; the call's arguments
read as HF reads them (default lengths, a generation config, numpy and tensor integers, float masks); fallbacks to
HF with their warning; bad input; no host sync inside a decode step; on a GPU, the CUDA-graph path.
"""

from __future__ import annotations

import gc
import re
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import fuselm
from fuselm.generation import engine as engine_module
from fuselm.generation.api import engine_of
from fuselm.generation.choice import PENALTY_SKIPS_PADDING
from fuselm.generation.options import read_options
from fuselm.patching.modules import FusedDecoderLayer
from tests.conftest import HAS_CUDA
from tests.helpers import HostSyncs, rel_err
from tests.models import FUSED_LAYERS, VOCAB, decode_model, tiny_model, token_ids
from tests.patching.test_decode import CACHE_ARG

PADS = (3, 0, 1)  # rows of 5, 8 and 7 real tokens
PROMPT = 8
NEW = 9  # more new tokens than the prompt


def left_padded(pads=PADS, prompt=PROMPT, seed=7):
    ids = token_ids(len(pads), prompt, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def hf_generate(model, ids, mask, **kwargs):
    """HF's own generate on the unpatched model, on fuselm's reference ops (unpatched: HF's ops)."""
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


def fused_generate(model, ids, mask, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the loop ran
        return fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **kwargs)


def eos_inside(model, ids, mask) -> int:
    """A token greedy decoding emits early in row 0 (but not at its first step), to stop that row mid-batch."""
    tokens = hf_generate(model, ids, mask, max_new_tokens=6, do_sample=False)[0, PROMPT:].tolist()
    return tokens[3]


@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_greedy_tokens_and_logits_match_hf(name, path):
    """The whole loop (prefill, decode steps, the first-call setup) against HF, with eos inside the batch; the
    model is patched for the call only."""
    model = decode_model(name)
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    asked = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, return_dict_in_generate=True,
                 output_logits=True)
    expected = hf_generate(model, ids, mask, **asked)
    out = fused_generate(model, ids, mask, **asked)
    assert not any(isinstance(m, FusedDecoderLayer) for m in model.modules())  # unpatched again
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences[0, PROMPT:] == eos).any()  # row 0 stopped inside the batch
    assert len(out.logits) == len(expected.logits) == out.sequences.shape[1] - PROMPT
    for step, (got, want) in enumerate(zip(out.logits, expected.logits)):
        assert rel_err(got, want) <= 1e-5, f"step {step}"


@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_a_long_prefills_last_layer_runs_for_the_last_position(name):
    """A left-padded prompt longer than DECODE_MAX_TOKENS: the loop reads only the prefill's last logits, so the
    last decoder layer's MLP runs for each row's last position alone (every other layer's for all 20), and the
    tokens and logits are HF's; the cache's flag is down again after the call. On the reference ops: the layer's
    kernels on that path are checked in tests/patching/test_decode.py (``test_last_position_only_prefill``)."""
    from fuselm.patching.modules import FusedGatedMLP

    model = decode_model(name)
    ids, mask = left_padded(prompt=20)
    asked = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = hf_generate(model, ids, mask, **asked)
    fuselm.patch(model)
    with (fuselm.use_backend("reference"),
          mock.patch.object(FusedGatedMLP, "forward", autospec=True, side_effect=FusedGatedMLP.forward) as forward):
        out = fused_generate(model, ids, mask, **asked)
    layers = model.model.layers
    rows = {layer: [x.shape[1] for mlp, x in (c.args for c in forward.call_args_list) if mlp is layer.mlp]
            for layer in layers}
    assert all(rows[layer] == [20] for layer in layers[:-1]) and rows[layers[-1]] == [1]
    assert torch.equal(out.sequences, expected.sequences)
    for step, (got, want) in enumerate(zip(out.logits, expected.logits, strict=True)):
        assert rel_err(got, want) <= 1e-5, f"step {step}"
    assert not engine_of(model)._buckets[4].cache.last_position_only


def test_a_hook_sees_every_position_of_the_last_layers_prefill():
    """A hook on some module of the model (here the last layer's MLP, which the fused step then calls as a module)
    sees what HF's generate shows it: the prefill's every position, not the last alone."""
    model = decode_model("llama")
    ids, mask = left_padded(prompt=20)
    expected = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    fuselm.patch(model)
    rows = []
    model.model.layers[-1].mlp.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[1]))
    assert torch.equal(fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False), expected)
    assert rows == [20, 1, 1]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_patched_model_generate_runs_the_loop(name):
    """A patched model's own generate takes fuselm's loop (and its second call reuses the bucket), with HF's
    tokens; with a cache passed in, HF's own loop runs."""
    model = decode_model(name)
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    fuselm.patch(model)
    with mock.patch.object(engine_module.DecodeEngine, "run", autospec=True,
                           side_effect=engine_module.DecodeEngine.run) as run:
        for _ in range(2):
            assert torch.equal(hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False), expected)
        assert run.call_count == 2
        assert list(engine_of(model)._buckets) == [4]  # three rows padded to the bucket of four
        cache = fuselm.generation.FusedKVCache(model, 3, 64)
        cache.plan(mask)
        out = hf_generate(model, ids, mask, max_new_tokens=4, do_sample=False, **{CACHE_ARG: cache})
        assert run.call_count == 2
    assert torch.equal(out, expected[:, :PROMPT + 4])


def test_patched_generate_takes_hfs_arguments_by_position():
    """HF's generate takes generation_config, logits_processor, ... by position: so does a patched model's, the loop
    running a generation config, HF a logits processor; two values for one argument is HF's TypeError."""
    from transformers import GenerationConfig, LogitsProcessorList, MinLengthLogitsProcessor

    model = decode_model("llama")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(PROMPT + 6, eos_token_id=eos)])
    expected = [model.generate(ids, config, attention_mask=mask), model.generate(ids, config, processors,
                                                                                 attention_mask=mask)]
    assert not torch.equal(*expected)
    fuselm.patch(model)
    with mock.patch.object(engine_module.DecodeEngine, "run", autospec=True,
                           side_effect=engine_module.DecodeEngine.run) as run:
        assert torch.equal(model.generate(ids, config, attention_mask=mask), expected[0])
        assert torch.equal(model.generate(ids, config, processors, attention_mask=mask), expected[1])
    assert run.call_count == 1
    with pytest.raises(TypeError, match="generation_config"):
        model.generate(ids, config, attention_mask=mask, generation_config=config)


def test_patched_generate_refuses_inputs_and_input_ids_together():
    """The prompt given twice, by position and as input_ids: HF's ValueError, from the patched model's generate too."""
    model = decode_model("llama")
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="input_ids") as hf_error:
        model.generate(ids, input_ids=ids, attention_mask=mask, max_new_tokens=3)
    with fuselm.patched(model), pytest.raises(ValueError, match=re.escape(str(hf_error.value))):
        model.generate(ids, input_ids=ids, attention_mask=mask, max_new_tokens=3)


def test_static_cache_generate_still_works_on_a_patched_model():
    model = decode_model("llama")
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=5, do_sample=False, cache_implementation="static",
                           disable_compile=True)
    with fuselm.patched(model):
        out = hf_generate(model, ids, mask, max_new_tokens=5, do_sample=False, cache_implementation="static",
                          disable_compile=True)
    assert torch.equal(out, expected)


def test_processors_match_hf_on_the_loops_logits():
    """Repetition penalty, min_new_tokens, temperature, top-k and top-p: the loop's scores are HF's processors and
    warpers (as HF's generate makes them: from transformers 5.23 on, the penalty skips the left padding) applied to
    the loop's raw logits and its tokens so far; greedy with the penalty gives HF's tokens."""
    model = decode_model("qwen2")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    greedy = dict(max_new_tokens=8, do_sample=False, repetition_penalty=1.7, eos_token_id=eos, min_new_tokens=5)
    assert torch.equal(fused_generate(model, ids, mask, **greedy), hf_generate(model, ids, mask, **greedy))
    sampled = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=9, top_p=0.8, repetition_penalty=1.3,
                   return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = fused_generate(model, ids, mask, **sampled)
    padding = (mask != 0).int().argmax(dim=1) if PENALTY_SKIPS_PADDING else None
    processors = [RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=padding), TemperatureLogitsWarper(0.7),
                  TopKLogitsWarper(9), TopPLogitsWarper(0.8)]
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        expected = raw
        for processor in processors:
            expected = processor(out.sequences[:, :PROMPT + step], expected)
        assert torch.equal(scores.isinf(), expected.isinf()), f"step {step}"
        finite = expected.isfinite()
        assert rel_err(scores[finite], expected[finite]) <= 1e-6
        assert scores.isfinite().gather(1, out.sequences[:, PROMPT + step, None]).all()  # a kept token is drawn


def test_sampling_is_seeded():
    model = decode_model("llama")
    ids, mask = left_padded()
    asked = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=0)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(fused_generate(model, ids, mask, **asked))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    top1 = fused_generate(model, ids, mask, max_new_tokens=10, do_sample=True, top_k=1)
    assert torch.equal(top1, hf_generate(model, ids, mask, max_new_tokens=10, do_sample=False))


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.values, self.ended = [], False

    def put(self, value):
        self.values.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_each_token():
    model = decode_model("mistral")
    ids = token_ids(1, 7, seed=5)
    streamer = Collect()
    out = fused_generate(model, ids, None, max_new_tokens=6, do_sample=False, streamer=streamer)
    assert torch.equal(out, hf_generate(model, ids, None, max_new_tokens=6, do_sample=False))
    assert streamer.ended and torch.equal(streamer.values[0], ids.cpu())
    assert torch.equal(torch.cat(streamer.values[1:]), out[0, 7:].cpu())


def test_max_length_counts_the_prompt():
    model = decode_model("llama")
    ids, mask = left_padded()
    assert torch.equal(fused_generate(model, ids, mask, max_length=PROMPT + 3, do_sample=False),
                       hf_generate(model, ids, mask, max_length=PROMPT + 3, do_sample=False))


def test_streamer_gets_only_the_steps_hf_keeps():
    """Every row done (here at the 4th of up to 20 tokens): the streamer gets HF's tokens, nothing after, then end."""
    model = decode_model("mistral")
    ids = token_ids(1, 7, seed=5)
    eos = int(hf_generate(model, ids, None, max_new_tokens=4, do_sample=False)[0, -1])
    streamers = Collect(), Collect()
    out = fused_generate(model, ids, None, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         streamer=streamers[0])
    expected = hf_generate(model, ids, None, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                           streamer=streamers[1])
    assert torch.equal(out, expected) and out.shape[1] < 7 + 20
    got, want = ([value.tolist() for value in streamer.values] for streamer in streamers)
    assert got == want and streamers[0].ended


def test_default_length_is_20_new_tokens_within_the_models_positions():
    """Neither max_new_tokens nor max_length set anywhere: HF's 20 new tokens, but no further than the model's
    max_position_embeddings (64); a max_length the model's generation config sets counts the prompt."""
    model = decode_model("llama")
    for prompt in (8, 50):
        ids = token_ids(1, prompt)
        expected = hf_generate(model, ids, None, do_sample=False)
        assert expected.shape[1] == min(prompt + 20, 64)
        assert torch.equal(fused_generate(model, ids, None, do_sample=False), expected)
        with fuselm.patched(model):
            assert torch.equal(hf_generate(model, ids, None, do_sample=False), expected)
    model.generation_config.max_length = PROMPT + 3
    ids = token_ids(1, PROMPT)
    expected = hf_generate(model, ids, None, do_sample=False)
    assert expected.shape[1] == PROMPT + 3
    assert torch.equal(fused_generate(model, ids, None, do_sample=False), expected)


def test_max_length_must_leave_a_new_token():
    """max_length up to the prompt's length: HF raises ValueError, and so do fuselm.generate and the patched model's
    generate, naming max_length."""
    model = decode_model("llama")
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="max_length"):
        hf_generate(model, ids, mask, max_length=PROMPT, do_sample=False)
    with pytest.raises(ValueError, match="max_length"):
        fused_generate(model, ids, mask, max_length=PROMPT, do_sample=False)
    with fuselm.patched(model), pytest.raises(ValueError, match="max_length"):
        hf_generate(model, ids, mask, max_length=PROMPT, do_sample=False)


def test_a_generation_config_takes_the_models_unset_fields():
    """generation_config=GenerationConfig(...): its unset fields come from the model's generation config (here eos
    and pad), as in HF's generate."""
    from transformers import GenerationConfig

    model = decode_model("qwen2")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 0
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False)
    expected = model.generate(ids, attention_mask=mask, generation_config=config)
    assert (expected[0, PROMPT:] == eos).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fuselm.generate(model, ids, attention_mask=mask, generation_config=config), expected)
    with fuselm.patched(model):
        assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=config), expected)


def test_generation_parameters_on_the_models_config_are_hfs_error():
    """A generation parameter set on model.config (not its generation_config): HF's generate refuses the call without
    a generation_config (ValueError naming it), and so do fuselm.generate and the patched model's generate; with one,
    HF runs it, and so does the loop."""
    from transformers import GenerationConfig

    model = decode_model("llama")
    ids, mask = left_padded()
    model.config.repetition_penalty = 1.5
    asked = dict(max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="repetition_penalty"):
        hf_generate(model, ids, mask, **asked)
    with pytest.warns(UserWarning, match="generation parameters"), pytest.raises(ValueError, match="repetition_pen"):
        fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked)
    with fuselm.patched(model), pytest.raises(ValueError, match="repetition_penalty"):
        hf_generate(model, ids, mask, **asked)
    config = GenerationConfig(pad_token_id=0, **asked)
    expected = model.generate(ids, attention_mask=mask, generation_config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fuselm.generate(model, ids, attention_mask=mask, generation_config=config), expected)


def test_min_new_tokens_wins_over_min_length():
    """Both set: HF keeps eos away for min_new_tokens steps (min_length is then the prompt plus min_new_tokens)."""
    model = decode_model("llama")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)  # row 0's 4th token
    asked = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, min_new_tokens=2, min_length=PROMPT + 8)
    expected = hf_generate(model, ids, mask, **asked)
    assert (expected[0, PROMPT:PROMPT + 4] == eos).any()
    assert torch.equal(fused_generate(model, ids, mask, **asked), expected)


def test_repetition_penalty_reads_the_left_padding_as_hf_does():
    """The padding's token id (here the token row 2 takes first) is penalised or not as HF's generate does: from
    transformers 5.23 on it is not, and row 2 takes it."""
    model = decode_model("llama")
    ids, mask = left_padded()
    asked = dict(max_new_tokens=4, do_sample=False, repetition_penalty=2.0, return_dict_in_generate=True,
                 output_scores=True)
    first = int(hf_generate(model, ids, mask, **asked).sequences[2, PROMPT])
    assert first not in ids[2].tolist()
    ids = ids.masked_fill(mask == 0, first)
    expected = model.generate(ids, attention_mask=mask, pad_token_id=first, **asked)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fuselm.generate(model, ids, attention_mask=mask, pad_token_id=first, **asked)
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.sequences[2, PROMPT] == first) == PENALTY_SKIPS_PADDING
    for got, want in zip(out.scores, expected.scores, strict=True):
        assert rel_err(got, want) <= 1e-5


def test_a_float_attention_mask_is_read_as_hf_reads_it():
    model = decode_model("llama")
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(hf_generate(model, ids, mask.float(), max_new_tokens=NEW, do_sample=False), expected)
    assert torch.equal(fused_generate(model, ids, mask.float(), max_new_tokens=NEW, do_sample=False), expected)
    with fuselm.patched(model):
        assert torch.equal(hf_generate(model, ids, mask.float(), max_new_tokens=NEW, do_sample=False), expected)


def test_a_mask_of_other_nonzero_values_numbers_positions_as_hf_does():
    """A mask of nonzero values other than 1 (here 2 everywhere, padding nowhere): HF keeps it, and numbers the
    positions by its running sum (1, 3, 5, ...) where no mask would count 0, 1, 2, ...; so do fuselm.generate and the
    patched model's generate."""
    model = decode_model("llama")
    ids = token_ids(2, PROMPT)
    twos = torch.full_like(ids, 2)
    asked = dict(max_new_tokens=NEW, do_sample=False)
    expected = hf_generate(model, ids, twos, **asked)
    assert not torch.equal(expected, hf_generate(model, ids, None, **asked))
    assert torch.equal(fused_generate(model, ids, twos, **asked), expected)
    with fuselm.patched(model):
        assert torch.equal(hf_generate(model, ids, twos, **asked), expected)


def test_no_attention_mask_reads_the_pad_tokens_as_padding_as_hf_does():
    """No attention_mask: HF's generate masks the prompt's pad_token_id tokens (the left padding here), unless that id
    is an eos id; so do fuselm.generate and the patched model's generate."""
    model = decode_model("llama")
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(hf_generate(model, ids, None, max_new_tokens=NEW, do_sample=False), expected)
    assert torch.equal(fused_generate(model, ids, None, max_new_tokens=NEW, do_sample=False), expected)
    with fuselm.patched(model):
        assert torch.equal(hf_generate(model, ids, None, max_new_tokens=NEW, do_sample=False), expected)
    unmasked = hf_generate(model, ids, None, max_new_tokens=NEW, do_sample=False, eos_token_id=0)
    assert not torch.equal(unmasked, expected)
    assert torch.equal(fused_generate(model, ids, None, max_new_tokens=NEW, do_sample=False, eos_token_id=0),
                       unmasked)


def test_an_int32_prompt_gives_int64_sequences():
    model = decode_model("llama")
    ids, mask = left_padded()
    ids = ids.int()
    expected = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    out = fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    assert out.dtype == expected.dtype == torch.int64 and torch.equal(out, expected)


def test_integer_arguments_of_any_integer_type():
    """numpy integers and one-element integer tensors for lengths and token ids, as HF takes them; sampling options
    of a greedy call are not read (HF ignores them); a length that is neither an integer nor a float (which goes to
    HF: test_a_float_length_goes_to_hf) is a TypeError naming it."""
    model = decode_model("llama")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    expected = hf_generate(model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=eos)
    for asked in (dict(max_new_tokens=np.int64(5)), dict(max_new_tokens=torch.tensor(5)),
                  dict(max_length=np.int64(PROMPT + 5)), dict(max_new_tokens=5, eos_token_id=np.int64(eos)),
                  dict(max_new_tokens=5, eos_token_id=torch.tensor([eos])), dict(max_new_tokens=5, top_p=0.0),
                  dict(max_new_tokens=5, top_p=1.5, top_k=-1, temperature=0.0)):
        asked = {"do_sample": False, "eos_token_id": eos, **asked}
        assert torch.equal(fused_generate(model, ids, mask, **asked), expected), asked
    for name in ("max_new_tokens", "max_length", "min_new_tokens"):
        with pytest.raises(TypeError, match=name):
            fuselm.generate(model, ids, attention_mask=mask, **{name: torch.tensor(PROMPT + 2.0)})


@pytest.mark.parametrize("asked", [dict(max_new_tokens=4.5), dict(max_new_tokens=5.0), dict(max_length=PROMPT + 4.0),
                                   dict(max_new_tokens=6, min_new_tokens=np.float64(3.0))],
                         ids=["max_new_tokens-4.5", "max_new_tokens-5.0", "max_length", "min_new_tokens"])
def test_a_float_length_goes_to_hf(asked):
    """HF's generate takes a float length (its stopping criteria compare it with the sequence length: 4.5 new tokens
    make 5); fuselm.generate hands such a call to HF with the warning naming it, a patched model's generate too
    (silently, as its other fallbacks)."""
    model = decode_model("llama")
    ids, mask = left_padded()
    asked = dict(do_sample=False, **asked)
    expected = hf_generate(model, ids, mask, **asked)
    name = next(k for k, value in asked.items() if isinstance(value, float))
    with pytest.warns(UserWarning, match=f"{name}=.* is no integer"):
        assert torch.equal(fuselm.generate(model, ids, attention_mask=mask, **asked), expected)
    with fuselm.patched(model), mock.patch.object(engine_module.DecodeEngine, "run", side_effect=AssertionError):
        assert torch.equal(hf_generate(model, ids, mask, **asked), expected)


def test_a_negative_eos_id_goes_to_hf():
    """A negative eos id: HF warns and runs (the id never ends a row), so fuselm hands the call to HF rather than
    refuse it."""
    model = decode_model("llama")
    ids, mask = left_padded()
    eos = eos_inside(model, ids, mask)
    for asked in (dict(eos_token_id=-1), dict(eos_token_id=[eos, -1])):
        asked = dict(max_new_tokens=NEW, do_sample=False, **asked)
        expected = hf_generate(model, ids, mask, **asked)
        with pytest.warns(UserWarning, match="eos_token_id .* has a negative id"):
            assert torch.equal(fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked), expected)
        with fuselm.patched(model):
            assert torch.equal(hf_generate(model, ids, mask, **asked), expected)


def test_assistant_options_go_to_hf():
    """assistant_early_exit asks HF for assisted decoding (which refuses a batch of 3) and is_assistant adds HF's
    confidence stopping criterion: neither is inert, both calls go to HF and give its result (here its error)."""
    model = decode_model("llama")
    ids, mask = left_padded()
    for asked in (dict(assistant_early_exit=1), dict(is_assistant=True)):
        asked = dict(max_new_tokens=NEW, do_sample=False, **asked)
        assert isinstance(read_options(model, PROMPT, None, asked), str)
        with pytest.raises((ValueError, TypeError)) as hf_error:
            hf_generate(model, ids, mask, **asked)
        with fuselm.patched(model), pytest.raises(hf_error.type, match=re.escape(str(hf_error.value))):
            hf_generate(model, ids, mask, **asked)


def test_negative_prompt_tensors_go_to_hf():
    """negative_prompt_ids and negative_prompt_attention_mask are tensors (of several elements): the call goes to HF,
    which runs it (they take part only with guidance_scale), rather than fail comparing them to an unset value."""
    model = decode_model("llama")
    ids, mask = left_padded()
    for asked in (dict(negative_prompt_ids=ids[:, :3]), dict(negative_prompt_attention_mask=mask[:, :3])):
        asked = dict(max_new_tokens=4, do_sample=False, **asked)
        expected = hf_generate(model, ids, mask, **asked)
        with pytest.warns(UserWarning, match="negative_prompt"):
            assert torch.equal(fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked), expected)
        with fuselm.patched(model):
            assert torch.equal(hf_generate(model, ids, mask, **asked), expected)


def test_sampling_options_are_checked_as_hf_checks_them():
    """When sampling: top_p above 1 filters nothing, top_p 0 keeps the best token; a temperature or top_k HF's
    warpers refuse is a ValueError naming it, from HF and fuselm alike."""
    model = decode_model("llama")
    ids, mask = left_padded()
    for top_p, kept in ((1.5, 1.0), (0.0, 0.0)):
        assert read_options(model, PROMPT, None, dict(do_sample=True, top_p=top_p, max_new_tokens=2)).top_p == kept
    greedy = hf_generate(model, ids, mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(fused_generate(model, ids, mask, max_new_tokens=4, do_sample=True, top_p=0.0, top_k=0),
                       greedy)
    for name, value in (("temperature", 0.0), ("top_k", -1), ("top_p", -0.5)):
        asked = {"max_new_tokens": 2, "do_sample": True, name: value}
        with pytest.raises(ValueError, match=name):
            hf_generate(model, ids, mask, **asked)
        with pytest.raises(ValueError, match=name):
            fuselm.generate(model, ids, attention_mask=mask, **asked)


def test_hybrid_cache_implementation_is_hfs_default_cache():
    """Gemma 2/3 generation configs name cache_implementation="hybrid", which HF 5 reads as unset: the loop runs."""
    for name in ("gemma2", "gemma3"):
        model = decode_model(name)
        model.generation_config.cache_implementation = "hybrid"
        ids, mask = left_padded()
        expected = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False), expected)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [2.0 + 0.3 * i for i in range(16)]}


def test_longrope_passing_its_original_length_goes_to_hf():
    """Phi-3 with longrope: HF computes the cache again with the long factors at the step that first feeds position
    original_max_position_embeddings (16); a call that would get there goes to HF (fuselm.generate with a warning,
    the patched model's generate silently), one that stops short of it or starts past it runs the loop."""
    model = tiny_model("phi3", hidden_size=256, original_max_position_embeddings=16, rope_parameters=dict(LONGROPE))
    model.generation_config.eos_token_id = None
    asked = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    for prompt, new in ((10, 7), (16, 1), (17, 4)):  # last fed positions 15, none, 19
        ids = token_ids(1, prompt)
        expected = hf_generate(model, ids, None, max_new_tokens=new, **asked)
        out = fused_generate(model, ids, None, max_new_tokens=new, **asked)
        assert torch.equal(out.sequences, expected.sequences)
        for got, want in zip(out.logits, expected.logits, strict=True):
            assert rel_err(got, want) <= 1e-5
    for prompt, new in ((10, 8), (16, 2)):
        ids = token_ids(1, prompt)
        expected = hf_generate(model, ids, None, max_new_tokens=new, **asked)
        with pytest.warns(UserWarning, match="original_max_position_embeddings"):
            out = fuselm.generate(model, ids, pad_token_id=0, max_new_tokens=new, **asked)
        assert torch.equal(out.sequences, expected.sequences)
    ids = token_ids(1, 10)
    expected = hf_generate(model, ids, None, max_new_tokens=12, do_sample=False)
    fuselm.patch(model)
    with mock.patch.object(engine_module.DecodeEngine, "run") as run:
        assert torch.equal(hf_generate(model, ids, None, max_new_tokens=12, do_sample=False), expected)
    assert run.call_count == 0


def test_transformers_output_capturing_hooks_leave_the_loop_on():
    """A forward asking for hidden states or attentions leaves transformers' (inert) output-capturing hooks on
    every layer and attention module: the loop still runs, patched model.generate too, as it does with output flags
    in the model's config; a user's hook on an attention module still sends the call to HF."""
    model = decode_model("llama")
    model.config._attn_implementation = "eager"  # HF captures attentions with eager attention only
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    with torch.no_grad():
        model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert model.model.layers[0]._forward_hooks and model.model.layers[0].self_attn._forward_hooks
    assert torch.equal(fused_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False), expected)
    fuselm.patch(model)
    with mock.patch.object(engine_module.DecodeEngine, "run", autospec=True,
                           side_effect=engine_module.DecodeEngine.run) as run:
        assert torch.equal(hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False), expected)
        model.config.output_hidden_states = model.config.output_attentions = True
        assert torch.equal(hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False), expected)
    assert run.call_count == 2
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    with pytest.warns(UserWarning, match="a hook watches the attention module of decoder layer 1"):
        fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False)


def test_a_call_leaves_the_models_generation_config_as_it_was():
    """The call's options go to a copy: the model's own config keeps its values (``read_options`` copies it)."""
    model = decode_model("llama")
    model.generation_config.eos_token_id = [5, 6]
    before = model.generation_config.to_dict()
    options = read_options(model, PROMPT, None, dict(max_new_tokens=4, do_sample=True, temperature=0.5, top_k=3,
                                                   eos_token_id=[7], repetition_penalty=1.3))
    assert (options.max_new_tokens, options.temperature, options.top_k, options.eos) == (4, 0.5, 3, (7,))
    assert model.generation_config.to_dict() == before


@pytest.mark.parametrize("case", ["beams", "processor", "head_dim", "training", "right_padding"])
def test_fallbacks_warn_and_give_hfs_result(case):
    model = tiny_model("llama", head_dim=24) if case == "head_dim" else decode_model("llama")
    ids, mask = left_padded()
    asked = dict(max_new_tokens=4, do_sample=False)
    if case == "beams":
        asked["num_beams"] = 2
    if case == "processor":
        from transformers import LogitsProcessorList, MinLengthLogitsProcessor

        asked["logits_processor"] = LogitsProcessorList([MinLengthLogitsProcessor(15, eos_token_id=2)])
    if case == "training":
        model.train()
    if case == "right_padding":
        mask = mask.flip(-1)
    expected = hf_generate(model, ids, mask, **asked)
    with pytest.warns(UserWarning, match="fuselm.generate: .*running model.generate instead"):
        out = fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked)
    assert torch.equal(out, expected)


def test_bad_input_names_the_argument():
    model = decode_model("llama")
    ids, mask = left_padded()
    with pytest.raises(TypeError, match="model"):
        fuselm.generate("gpt2", ids)
    with pytest.raises(TypeError, match="input_ids"):
        fuselm.generate(model, ids.float())
    with pytest.raises(TypeError, match="input_ids"):
        fuselm.generate(model, ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        fuselm.generate(model, ids, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="max_new_tokens"):
        fuselm.generate(model, ids, attention_mask=mask, max_new_tokens=-1)
    with pytest.raises(TypeError, match="attention_mask"):
        fuselm.generate(model, ids, attention_mask=mask.to(torch.complex64))


def _decoded_bucket(name: str, dtype: torch.dtype = torch.float32, **generation_kwargs):
    """(model, engine, bucket, options, output) after one fused generate call over ``left_padded()``; the options
    are read without the output flags, as a decode step runs them."""
    model = decode_model(name, dtype)
    fuselm.patch(model)
    ids, mask = left_padded()
    out = fused_generate(model, ids, mask, **generation_kwargs)
    engine = engine_of(model)
    kwargs = {k: v for k, v in generation_kwargs.items() if k not in ("output_scores", "return_dict_in_generate")}
    return model, engine, engine._buckets[4], read_options(model, PROMPT, None, kwargs), out


@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_decode_step_never_syncs(name):
    """What a CUDA graph captures: the whole step, sampling with every processor on, reads nothing back."""
    model, engine, bucket, options, out = _decoded_bucket(  # model bound: the engine holds it weakly
        name, max_new_tokens=2, do_sample=True, top_k=5, top_p=0.9, repetition_penalty=1.2, min_new_tokens=2,
        eos_token_id=2, output_scores=True, return_dict_in_generate=True)
    with HostSyncs() as syncs:
        engine._decode_step(bucket, options)
    assert syncs.seen == [] and out.sequences.shape == (3, PROMPT + 2)


def test_padded_call_reads_its_mask_once():
    """fuselm.generate reads a padded mask back once, before the loop (that it pads on the left only, and whether it
    pads at all): the loop plans the cache from it, through its prefill, reading nothing back."""
    model = decode_model("llama")
    ids, mask = left_padded()
    expected = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    run, prefill, seen = engine_module.DecodeEngine.run, engine_module.DecodeEngine._prefill, []

    def watched_run(self, *args, **kwargs):
        with HostSyncs() as syncs:
            def watched_prefill(engine, *prefill_args):
                seen.append(list(syncs.seen))  # the reads between run's start and the prefill
                return prefill(engine, *prefill_args)

            with mock.patch.object(engine_module.DecodeEngine, "_prefill", watched_prefill):
                return run(self, *args, **kwargs)

    with mock.patch.object(engine_module.DecodeEngine, "run", watched_run):
        outs = [fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False) for _ in range(2)]
    assert seen[1] == []  # the second call: its bucket and the rotary tables exist
    assert all(torch.equal(out, expected) for out in outs)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_decode_step_builds_no_mask_and_gathers_the_rotary_embedding(name):
    """Inside a decode step HF's mask functions never run, and the rotary modules' own forward runs only to fill
    the tables (once per bucket), not per step; the config's attention implementation is restored after."""
    from transformers import masking_utils

    model, engine, bucket, options, _ = _decoded_bucket(name, max_new_tokens=2, do_sample=False)
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    bucket.rotary.clear()  # made again below, inside the count
    implementation = model.config._attn_implementation
    mask_functions = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    counted = {key: mock.Mock(wraps=function) for key, function in mask_functions.items()}
    with mock.patch.dict(mask_functions, counted), \
            mock.patch.object(type(rotary), "forward", autospec=True, side_effect=type(rotary).forward) as forward:
        engine._decode_step(bucket, options)  # the tables are made now (the patched forward is a new function)
        made = forward.call_count
        engine._decode_step(bucket, options)
    assert made >= 1 and forward.call_count == made, "a step after the first computes no rotary embedding"
    assert all(function.call_count == 0 for function in counted.values())
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("name", FUSED_LAYERS)
@pytest.mark.parametrize("prompt", [12, 24])
def test_unpadded_prefill_never_syncs(name, prompt):
    """What a prefill graph captures: the forward over an unpadded prompt (an all-ones mask is dropped: HF's masks
    are those of no mask) reads nothing back; a prompt within DECODE_MAX_TOKENS takes the fused decode step, a
    longer one the prefill path. The tokens are HF's with that mask."""
    model = decode_model(name)
    ids = token_ids(2, prompt)
    mask = torch.ones_like(ids)
    expected = hf_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    fuselm.patch(model)
    prefill, seen = engine_module.DecodeEngine._prefill, []

    def watched(self, bucket, ids, positions, mask):
        with HostSyncs() as syncs:
            out = prefill(self, bucket, ids, positions, mask)
        seen.append((mask, syncs.seen))
        return out

    with mock.patch.object(engine_module.DecodeEngine, "_prefill", watched):
        out = fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    assert seen == [(None, [])]
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("name", "prompt", "masked"), [("llama", 24, False), ("mistral", 5, False),
                                                      ("mistral", 24, True), ("gemma2", 24, True)])
def test_unpadded_prefill_builds_a_mask_only_where_one_is_needed(name, prompt, masked):
    """HF builds no mask for an unpadded prefill whose layers all attend causally over the whole prompt (SDPA's
    is_causal is that mask): it does for a prompt as long as a sliding window, and with soft-capping; the tokens are
    HF's either way, and the config's attention implementation is restored after."""
    from transformers import masking_utils

    model = decode_model(name)
    ids = token_ids(2, prompt)
    expected = hf_generate(model, ids, None, max_new_tokens=3, do_sample=False)
    fuselm.patch(model)
    implementation = model.config._attn_implementation
    mask_functions = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    counted = {key: mock.Mock(wraps=function) for key, function in mask_functions.items()}
    with mock.patch.dict(mask_functions, counted):
        out = fused_generate(model, ids, None, max_new_tokens=1, do_sample=False)
    assert any(function.call_count for function in counted.values()) == masked
    assert torch.equal(out, expected[:, :prompt + 1])
    assert torch.equal(fused_generate(model, ids, None, max_new_tokens=3, do_sample=False), expected)
    assert model.config._attn_implementation == implementation


def test_prefill_graphs_capture_a_repeated_length_and_keep_the_recent_ones():
    """The capture policy: a length is captured at its second call, replayed after; at most PREFILL_GRAPHS are kept
    (least recently used freed first); a failed capture stops further tries until clear()."""
    graphs = engine_module.PrefillGraphs()
    assert graphs.lookup(10) == (None, False)
    assert graphs.lookup(10) == (None, True)
    graphs.keep(10, "graph 10")
    assert graphs.lookup(10) == ("graph 10", False)
    for length in range(11, 11 + engine_module.PREFILL_GRAPHS):
        graphs.lookup(length)
        graphs.lookup(length)
        graphs.keep(length, f"graph {length}")
        graphs.lookup(10)  # 10 stays the most recently used
    assert 10 in graphs.graphs and 11 not in graphs.graphs and len(graphs.graphs) == engine_module.PREFILL_GRAPHS
    assert graphs.lookup(11) == (None, True)  # freed, but seen: captured again at once
    graphs.failed = True
    assert graphs.lookup(11) == (None, False) and graphs.lookup(99) == (None, False)
    graphs.clear()
    assert graphs.graphs == {} and graphs.lookup(11) == (None, False) and graphs.lookup(11) == (None, True)


def test_captures_share_a_live_graphs_pool(monkeypatch):
    """The pool a capture joins: a live graph's (any bucket's decode steps, then its prefills), else a new handle, as
    a pool dies with its last graph (test_captures_after_the_engines_last_graph_was_freed runs it on the GPU)."""

    class Graph:
        def __init__(self, pool):
            self._pool = pool

        def pool(self):
            return self._pool

    model = decode_model("llama")
    fuselm.patch(model)
    fused_generate(model, token_ids(1, 5), None, max_new_tokens=2, do_sample=False)  # one bucket (no graphs on CPU)
    engine = engine_of(model)
    handles = iter(range(100, 200))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    assert (engine._graph_pool(), engine._graph_pool()) == (100, 101)
    bucket = engine._buckets[1]
    bucket.prefills.keep("a length", engine_module._PrefillGraph(Graph(7), None, None, None, None))
    assert engine._graph_pool() == 7
    bucket.graphs["a mode"] = Graph(5)
    assert engine._graph_pool() == 5
    bucket.graphs.clear()
    bucket.prefills.clear()
    assert engine._graph_pool() == 102


def test_engine_is_freed_with_the_model():
    model = decode_model("llama")
    ids, mask = left_padded()
    fuselm.patch(model)
    fused_generate(model, ids, mask, max_new_tokens=3, do_sample=False)
    engine = engine_of(model)
    del model
    gc.collect()
    with pytest.raises(RuntimeError, match="freed"):
        engine.model  # noqa: B018


# ----------------------------------------------------------------------------------------------- GPU
BF16_TIE_MARGIN = 0.05  # fp32 logit gap below which bf16 (8 mantissa bits: a step of 1/64 near 4) cannot decide


def assert_same_decisive_tokens(out, hf, fp32, steps: int) -> None:
    """out's first ``steps`` greedy tokens equal HF bf16's wherever the choice is decided: per row, step by step
    while fp32 HF chose the same tokens, each step whose fp32 top-2 logit gap is at least BF16_TIE_MARGIN must
    agree; a closer gap is a tie bf16 rounding may break either way (HF's own bf16 run included), and ends that
    row's comparison (the sequences then continue from different tokens). At least half the steps are decisive."""
    decided = 0
    for row in range(out.sequences.shape[0]):
        for step in range(steps):
            top2 = fp32.logits[step][row].float().topk(2).values
            if top2[0] - top2[1] < BF16_TIE_MARGIN:
                break
            token = PROMPT + step
            assert out.sequences[row, token] == hf.sequences[row, token] == fp32.sequences[row, token], (
                f"row {row}, step {step}: fuselm {out.sequences[row, token]}, HF bf16 {hf.sequences[row, token]}, "
                f"HF fp32 {fp32.sequences[row, token]} (fp32 top-2 gap {top2[0] - top2[1]:.3f})")
            decided += 1
    assert decided >= out.sequences.shape[0] * steps / 2, f"only {decided} decisive steps to compare"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_a_prompt_on_the_cpu_gets_its_outputs_on_the_cpu():
    """HF's generate keeps input_ids where they are (it moves only the model's inputs to the model): a prompt on the
    CPU for a model on the GPU gets its sequences, scores and logits on the CPU, from fuselm.generate and the patched
    model's generate alike."""
    model = decode_model("llama")
    ids, mask = (t.cpu() for t in left_padded())
    asked = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True,
                 output_logits=True)
    expected = hf_generate(model, ids, mask, **asked)
    outs = [fused_generate(model, ids, mask, **asked)]
    fuselm.patch(model)
    with mock.patch.object(engine_module.DecodeEngine, "run", autospec=True,
                           side_effect=engine_module.DecodeEngine.run) as run:
        outs.append(hf_generate(model, ids, mask, **asked))
    assert run.call_count == 1
    for out in outs:
        assert out.sequences.device == expected.sequences.device == torch.device("cpu")
        assert torch.equal(out.sequences, expected.sequences)
        for got, want in zip(out.scores + out.logits, expected.scores + expected.logits, strict=True):
            assert got.device == want.device and rel_err(got, want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "phi3"])
def test_graph_path_in_bf16(name):
    """bf16 on the GPU: the graph replays (one capture serves two calls); the first steps' tokens agree with HF
    eager where bf16 can decide them (assert_same_decisive_tokens) and the logits stay within HF's own bf16-vs-fp32
    error (times a margin for the different kernels)."""
    model = decode_model(name, torch.bfloat16)
    ids, mask = left_padded()
    asked = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    hf = hf_generate(model, ids, mask, **asked)
    fp32 = hf_generate(decode_model(name), ids, mask, **asked)
    fuselm.patch(model)
    for _ in range(2):
        out = fused_generate(model, ids, mask, **asked)
    assert engine_of(model).captures == 1
    assert_same_decisive_tokens(out, hf, fp32, steps=2)
    hf_error = rel_err(hf.logits[0], fp32.logits[0])
    assert rel_err(out.logits[0], fp32.logits[0]) <= 3 * hf_error + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_fused_prefill_attention_in_bf16(name):
    """bf16 on the GPU, a 40-token left-padded prompt: the prefill runs the fused prefill attention in every layer
    (cuBLAS, the q/k/v epilogue writing the cache, SDPA over its first slots), and the first token's logits stay
    within HF's own bf16-vs-fp32 error (times a margin for the different kernels)."""
    from fuselm.patching import decode

    model = decode_model(name, torch.bfloat16)
    ids, mask = left_padded(prompt=40)
    asked = dict(max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_logits=True)
    hf = hf_generate(model, ids, mask, **asked)
    fp32 = hf_generate(decode_model(name), ids, mask, **asked)
    fuselm.patch(model)
    with mock.patch.object(decode, "prefill_attention", wraps=decode.prefill_attention) as prefill:
        out = fused_generate(model, ids, mask, **asked)
    assert prefill.call_count == model.config.num_hidden_layers
    hf_error = rel_err(hf.logits[0], fp32.logits[0])
    assert rel_err(out.logits[0], fp32.logits[0]) <= 3 * hf_error + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_prefill_graph_replays_the_eager_prefill(name):
    """bf16 on the GPU: an unpadded prompt length is prefilled eagerly at its first call, captured at its second
    and replayed at its third, each with the first call's tokens and logits; another length in between (and its
    capture) leaves the first's graph right; a left-padded batch is never captured."""
    model = decode_model(name, torch.bfloat16)
    fuselm.patch(model)
    asked = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ids, other = token_ids(2, 40), token_ids(2, 33, seed=3)
    engine = engine_of(model)
    eager = fused_generate(model, ids, None, **asked)
    assert engine.prefill_captures == 0
    for captures in (1, 2, 2, 2):
        out = fused_generate(model, ids, None, **asked)
        assert torch.equal(out.sequences, eager.sequences)
        assert rel_err(out.logits[0], eager.logits[0]) <= 1e-3
        fused_generate(model, other, None, **asked)
        assert engine.prefill_captures == captures
    padded, mask = left_padded(prompt=40)
    for _ in range(3):
        fused_generate(model, padded, mask, **asked)
    assert engine.prefill_captures == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_captures_after_the_engines_last_graph_was_freed():
    """A longer prompt grows the bucket's cache and frees its graphs, here the engine's only ones: the next captures
    (the prefill at the length's second call, then the decode step) take a memory pool that lives, and the CUDA
    generator works after them. The freed pool's handle failed PyTorch's allocator assert (session 31)."""
    model = decode_model("llama", torch.bfloat16)
    fuselm.patch(model)
    engine = engine_of(model)
    fused_generate(model, token_ids(1, 5), None, max_new_tokens=4, do_sample=False)
    assert engine.captures == 1
    longer = token_ids(1, engine_module.CACHE_GRANULE + 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not be captured", category=RuntimeWarning)
        for _ in range(2):
            fused_generate(model, longer, None, max_new_tokens=1, do_sample=False)
        assert engine.prefill_captures == 1
        fused_generate(model, longer, None, max_new_tokens=4, do_sample=False)
    assert engine.captures == 2
    assert torch.isfinite(torch.randn(4, device=model.device)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_decode_step_profile_names_fuselm_ops():
    model, engine, bucket, options, _ = _decoded_bucket("llama", torch.bfloat16, max_new_tokens=3, do_sample=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine._decode_step(bucket, options)
    names = {event.name for event in profile.events()}
    assert {"fuselm::qkv_rope", "fuselm::decode_attention", "fuselm::linear_residual",
            "fuselm::norm_gated_linear"} <= names


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_no_memory_growth_over_many_steps():
    """1000 decode steps over varying batch sizes and prompt lengths: memory after the first two rounds of buckets
    stays flat."""
    model = decode_model("llama", torch.bfloat16)
    fuselm.patch(model)
    shapes = [(1, 5), (3, 9), (2, 17), (1, 30)]
    for _ in range(2):  # every bucket, cache, decode step and (at a prompt length's second call) prefill captured
        for batch, prompt in shapes:
            fused_generate(model, token_ids(batch, prompt), None, max_new_tokens=40, do_sample=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for round_ in range(6):
        for batch, prompt in shapes:
            fused_generate(model, token_ids(batch, prompt, seed=round_), None, max_new_tokens=40, do_sample=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def test_each_eos_count_keeps_its_buffer():
    """A graph captured for calls with n eos ids reads that buffer on every replay: a call with another count must
    not replace it."""
    model = decode_model("llama")
    ids, mask = left_padded()
    fuselm.patch(model)
    for eos in ([5], [5, 6]):
        fused_generate(model, ids, mask, max_new_tokens=2, do_sample=False, eos_token_id=eos)
    state = engine_of(model)._buckets[4].state
    one, two = state.eos_buffer(1), state.eos_buffer(2)
    fused_generate(model, ids, mask, max_new_tokens=2, do_sample=False, eos_token_id=[7])
    assert state.eos_buffer(1) is one and state.eos_buffer(2) is two
    assert one.tolist() == [7] and two.tolist() == [5, 6]


def test_a_call_loads_only_option_values_that_changed():
    """ChoiceState.start copies the option values to the device only when they differ from the loaded ones, and
    always leaves the call's values there (another call's in between included)."""
    import dataclasses

    from fuselm.generation.choice import ChoiceState
    from fuselm.generation.options import DecodeOptions

    base = DecodeOptions(max_new_tokens=4, min_new_tokens=2, do_sample=True, temperature=0.7, top_k=0, top_p=0.9,
                         repetition_penalty=1.3, eos=(5,), pad=0, output_scores=False, output_logits=False,
                         return_dict=False)
    other = dataclasses.replace(base, temperature=1.5, min_new_tokens=0, eos=(6,), pad=6)
    state, prompt = ChoiceState(2, VOCAB, 8, torch.device("cpu")), token_ids(2, 3)

    for options in (base, other, base):
        with mock.patch.object(torch, "tensor", wraps=torch.tensor) as made:
            state.start(options, prompt, None, 2)
        assert made.call_count == 3
        assert state.values.tolist() == pytest.approx([options.temperature, options.top_p,
                                                       options.repetition_penalty])
        assert state.limits.tolist() == [options.min_new_tokens, options.pad] and state.eos.tolist() == [*options.eos]
        with mock.patch.object(torch, "tensor", wraps=torch.tensor) as made:
            state.start(options, prompt, None, 2)
        assert made.call_count == 0


def test_a_model_the_caller_patched_stays_patched():
    """Patched without fused decoder layers: the call falls back to HF with its warning, and the caller's patch is
    neither replaced nor undone."""
    model = decode_model("llama")
    fuselm.patch(model, decoder_layer=False)
    classes = [type(m) for m in model.modules()]
    ids, mask = left_padded()
    with pytest.warns(UserWarning, match="is not fused by fuselm.patch"):
        fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, do_sample=False)
    assert [type(m) for m in model.modules()] == classes


def test_the_model_check_follows_changes_between_calls():
    """The loop's model check is cached between calls but redone when the model changed: its mode, a module's class
    (a decoder layer unpatched), a parameter (a new weight), a hook on an attention module (added, then removed)."""
    model = decode_model("llama")
    fuselm.patch(model)
    ids, mask = left_padded()
    asked = dict(max_new_tokens=3, do_sample=False)
    expected = hf_generate(model, ids, mask, **asked)
    assert torch.equal(fused_generate(model, ids, mask, **asked), expected)
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked)
    model.eval()
    assert torch.equal(fused_generate(model, ids, mask, **asked), expected)
    layer = next(m for m in model.modules() if isinstance(m, FusedDecoderLayer))
    fuselm.unpatch(layer)
    with pytest.warns(UserWarning, match="is not fused by fuselm.patch"):
        fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked)
    fuselm.patch(model)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    assert torch.equal(fused_generate(model, ids, mask, **asked), hf_generate(model, ids, mask, **asked))
    calls = []
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda *args: calls.append(1))
    with pytest.warns(UserWarning, match="a hook watches the attention module of decoder layer 1"):
        tokens = fuselm.generate(model, ids, attention_mask=mask, pad_token_id=0, **asked)
    assert len(calls) == asked["max_new_tokens"]  # HF's loop calls the module at every step
    handle.remove()
    assert torch.equal(tokens, hf_generate(model, ids, mask, **asked))
    assert torch.equal(fused_generate(model, ids, mask, **asked), tokens)
