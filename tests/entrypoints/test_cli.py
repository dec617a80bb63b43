"""The `vllm` command line: --version, `serve --help` (in a fresh interpreter), both flag
spellings, the forms of --lora-modules, and a start-up failure that is a message rather
than a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.entrypoints.utils import REPO_ROOT
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import main, make_parser, normalize_flags
from vllm.entrypoints.openai.cli_args import engine_args_from
from vllm.entrypoints.openai.serving_models import LoRAModulePath
from vllm.version import __version__


def test_version_and_help(capsys):
    main(["--version"])
    assert capsys.readouterr().out.strip() == __version__
    # the real entry point, in a fresh interpreter
    result = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0
    for flag in ("--enable-activated-lora", "--lora-modules", "--max-model-len", "--served-model-name",
                 "--api-key", "--chat-template", "--port", "--host", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--max-lora-rank", "--uvicorn-log-level"):
        assert flag in result.stdout, flag


def test_dash_and_underscore_spellings():
    parser = make_parser()
    dash = parser.parse_args(["serve", "m", "--max-model-len", "128", "--served-model-name", "x_y"])
    under = parser.parse_args(["serve", "m", "--max_model_len", "128", "--served_model_name=x_y"])
    assert dash.max_model_len == under.max_model_len == 128
    assert dash.served_model_name == under.served_model_name == ["x_y"]  # values keep their underscores
    assert normalize_flags(["--a_b=c_d", "e_f", "--", "--g_h"]) == ["--a-b=c_d", "e_f", "--", "--g_h"]


def test_model_defaults_and_engine_flags():
    parser = make_parser()
    args = parser.parse_args(["serve", "--enable-lora", "--enable-activated-lora", "--no-enable-prefix-caching",
                              "--max-lora-rank", "64", "--enable-prompt-tokens-details",
                              "--long-prefill-token-threshold", "256"])
    engine_args = engine_args_from(args)
    assert engine_args.long_prefill_token_threshold == 256
    assert engine_args.model == EngineArgs.model
    assert engine_args.enable_lora and engine_args.enable_activated_lora and not engine_args.enable_prefix_caching
    assert engine_args.max_lora_rank == 64
    assert engine_args_from(parser.parse_args(["serve", "some/model"])).model == "some/model"


def test_lora_modules_forms():
    parser = make_parser()
    args = parser.parse_args([
        "serve", "m", "--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}',
        "--lora-modules", "c=/p/c",
    ])
    assert args.lora_modules == [LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b", "m"),
                                 LoRAModulePath("c", "/p/c")]
    for bad in ("no-equals-sign", '{"name": "x"}', "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--lora-modules", bad])


def test_bad_adapter_fails_start_up_with_a_message(llama_dir, tmp_path, capsys):
    args = make_parser().parse_args(["serve", llama_dir, "--max-model-len", "64", "--enable-lora",
                                     "--lora-modules", f"x={tmp_path}", "--port", "0"])
    with pytest.raises(SystemExit) as exit_info:
        args.dispatch(args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("vllm serve: error:") and "'x'" in err and "Traceback" not in err
