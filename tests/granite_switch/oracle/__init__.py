"""Scripts run inside .venv-granite-switch (granite-switch 0.1.1, transformers 5.17).

Not imported by pytest: tests.granite_switch.oracle_env runs them as subprocesses.
"""
