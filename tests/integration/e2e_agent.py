"""``tmd agent`` of one simulated machine, on a fake NVML (no GPU here), for the
end-to-end tests: the real Agent, publishing to a real broker; the test makes GPU
``--gpu`` report XID ``--xid`` by creating the file ``--trigger``.

    python e2e_agent.py --broker HOST:PORT --node m1 --trigger PATH [--gpus 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.fakes.nvml import FakeNvml
from tmd import config as config_mod
from tmd.agent.agent import Agent
from tmd.agent.nvml import Nvml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--trigger", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--gpu", type=int, default=1)
    parser.add_argument("--xid", type=int, default=79)
    args = parser.parse_args()
    host, port = args.broker.rsplit(":", 1)
    config = config_mod.from_dict({
        "mqtt": {"host": host, "port": int(port), "reconnect_min_s": 0.1},
        "agent": {"node": args.node, "interval_s": 0.2, "xid_wait_ms": 50},
    })  # fmt: skip
    fake = FakeNvml(args.gpus)

    def fire_when_told() -> None:
        while not args.trigger.exists():
            time.sleep(0.05)
        fake.xid(args.gpu, args.xid)

    threading.Thread(target=fire_when_told, daemon=True).start()
    nvml = Nvml.open(fake)
    try:
        asyncio.run(Agent(config, nvml=nvml).run())
    finally:
        nvml.close()


if __name__ == "__main__":
    main()
