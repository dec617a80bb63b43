"""benchmarks/common.py's model choice: the dummy shapes (--granite-8b-dummy, --granite-2b-dummy)
write configs that transformers and the engine read as the named model's shapes, the two flags
exclude each other, and a dummy choice runs with random weights (load_format="dummy")."""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks.common import DUMMY_SHAPES, add_model_args, dummy_dir, load_hf_config, resolve_model, server_flags

# (hidden, intermediate, layers, KV heads) of Granite-3.3-8B and -2B (their published configs).
SHAPES = {"granite-3.3-8b": (4096, 12800, 40, 8), "granite-3.3-2b": (2048, 8192, 40, 8)}


@pytest.mark.parametrize("shape", sorted(DUMMY_SHAPES))
def test_dummy_folder_has_the_shapes_and_a_tokenizer(shape, tmp_path):
    path = dummy_dir(str(tmp_path), shape)
    config = load_hf_config(path)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_key_value_heads) == SHAPES[shape]
    assert config.architectures == ["GraniteForCausalLM"] and config.tie_word_embeddings
    assert os.path.exists(os.path.join(path, "tokenizer.json"))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args(argv)


def test_dummy_flags_pick_a_shape_and_exclude_each_other(capsys):
    assert _parse([]).dummy is None
    assert _parse(["--granite-8b-dummy"]).dummy == "granite-3.3-8b"
    assert _parse(["--granite-2b-dummy"]).dummy == "granite-3.3-2b"
    with pytest.raises(SystemExit):
        _parse(["--granite-8b-dummy", "--granite-2b-dummy"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_dummy_choice_runs_on_random_weights(tmp_path):
    args = _parse(["--granite-2b-dummy", "--dtype", "bfloat16"])
    model_dir, kwargs = resolve_model(args, root=str(tmp_path))
    assert load_hf_config(model_dir).hidden_size == 2048
    assert kwargs == {"load_format": "dummy", "dtype": "bfloat16"}
    assert server_flags(args) == ["--load-format", "dummy", "--dtype", "bfloat16"]
