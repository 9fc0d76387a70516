"""The runtime tests' training script, with one machine made really slow.

``E2E_SLOW_NODE`` names the node (``TMD_NODE``) whose every forward pass sleeps
``E2E_SLOW_S`` seconds more: a straggler in the compute part of the step, which is
where the detector looks. Sleeping changes no number, so the trained parameters are
those of an unslowed run; a standby that takes the slow node's place is not slow.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.runtime_conftest_helpers import train

SCRIPT = str(Path(__file__).resolve())

if __name__ == "__main__":
    slow = os.environ.get("E2E_SLOW_NODE", "")
    if slow and os.environ.get("TMD_NODE") == slow:
        delay = float(os.environ.get("E2E_SLOW_S", "0.2"))
        mse_loss = torch.nn.functional.mse_loss

        def slow_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            time.sleep(delay)
            return mse_loss(*args, **kwargs)

        torch.nn.functional.mse_loss = slow_loss
    # Everything loaded so far (torch) lives until the process ends: frozen, the
    # collector leaves it alone, at exit too (see runtime_conftest_helpers).
    gc.freeze()
    train(sys.argv[1:])
