"""The node agent (``tmd agent``), on every worker and standby machine: NVML samples,
XID events and the machine's liveness, published over MQTT.

It imports only what every role shares (``tmd.wire``, ``tmd.config``, ``tmd.log``,
``tmd.connection``, ``tmd.sdnotify``), never the daemon: GPU nodes install
``tmd[agent]`` and run nothing else of tmd.
"""
