"""Sampling defaults from generation_config.json (appliance/generation_defaults.py): which keys,
`do_sample: false` as greedy, the `none` and folder sources, and the errors for a folder without
the file or values no request may take."""

from __future__ import annotations

import json

import pytest

from appliance.generation_defaults import GenerationConfigError, describe, generation_defaults


def write(folder, **config):
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_sampling_keys_of_the_models_file(tmp_path):
    model = write(
        tmp_path / "m",
        do_sample=True,
        temperature=0.6,
        top_k=20,
        top_p=0.95,
        eos_token_id=[1, 2],
        max_new_tokens=100,
    )
    defaults = generation_defaults(model)
    # max_new_tokens caps max_tokens, as in vLLM
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 100}
    assert describe(defaults) == "temperature 0.6, top_p 0.95, top_k 20, max_tokens at most 100"
    assert generation_defaults(model, "none") == generation_defaults(model, "vllm") == {}
    assert describe({}) == "the OpenAI defaults"


def test_do_sample_false_is_greedy(tmp_path):
    model = write(tmp_path / "m", do_sample=False, temperature=0.7, repetition_penalty=1.1)
    assert generation_defaults(model) == {"repetition_penalty": 1.1, "temperature": 0.0}


def test_a_folder_source_and_a_model_without_the_file(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert generation_defaults(bare) == {}  # auto: nothing to apply
    other = write(tmp_path / "other", min_p=0.05)
    assert generation_defaults(bare, str(other)) == {"min_p": 0.05}
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        generation_defaults(bare, str(bare))


def test_values_no_request_may_take_name_the_file_and_field(tmp_path):
    with pytest.raises(GenerationConfigError, match="generation_config.json: max_tokens"):
        generation_defaults(write(tmp_path / "zero", max_new_tokens=0))
    model = write(tmp_path / "m", temperature=-1)
    with pytest.raises(GenerationConfigError, match="generation_config.json: temperature"):
        generation_defaults(model)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="not readable JSON"):
        generation_defaults(model)
