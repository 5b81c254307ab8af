"""The test scripts' one way of running under the interpreter that has their packages.

The python tests (tests/lm_transformers.py, hf_checkpoint.py, moe_torch.py, lowp_ml_dtypes.py)
are started by ctest with the first python3 it finds and take `--python PATH`, the virtual
environment scripts/setup.sh makes (.venv-hf): where that interpreter exists and is not the one
running, the script starts again under it with the same arguments; otherwise it goes on, and
reports itself skipped if a package it needs is missing.
"""
import os
import sys


def rerun_under(python, script):
    """Replaces this process by `python script <this process's arguments>` when `python` is given,
    exists and is another interpreter; returns otherwise."""
    if python and os.path.exists(python) and \
            os.path.abspath(sys.executable) != os.path.abspath(python):
        os.execv(python, [python, os.path.abspath(script)] + sys.argv[1:])
