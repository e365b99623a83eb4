"""On a test worker's PYTHONPATH: each training step sleeps ``FT_TEST_STEP_DELAY_S`` first.

The tiny model trains 40 steps in about a second, faster than run monitoring polls (5 s): a test that
must preempt a worker mid-run, after monitoring saw it and after its first checkpoint, slows the steps
of the processes it cannot reach in-process (a managed job's attempt runs under bash, then
``dagster api``). The patch lands when ``ft_assets.training.steps`` is imported, so processes that never
train start as fast as before (no torch import at startup).
"""

import importlib.abc
import importlib.util
import os
import sys
import time

DELAY_S = float(os.environ.get("FT_TEST_STEP_DELAY_S") or 0)
MODULE = "ft_assets.training.steps"


class SlowedSteps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # find the module as Python would have, then wrap its loading
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            token_loss_sum = module.token_loss_sum

            def slowed(model, batch, **options):
                time.sleep(DELAY_S)
                return token_loss_sum(model, batch, **options)

            module.token_loss_sum = slowed

        spec.loader.exec_module = exec_module
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, SlowedSteps())
