"""The `vllm` logger: one handler, level from VLLM_LOGGING_LEVEL."""

import logging
import sys

from vllm import envs

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_root = logging.getLogger("vllm")
if not _root.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(envs.VLLM_LOGGING_LEVEL.upper())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
