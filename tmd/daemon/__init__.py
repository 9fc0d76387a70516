"""The head-node daemon: ingest, cluster view, bus, events, plug-in runner, journal,
HTTP API and metrics, and the actuator that turns decisions into migrations.

``tmd.daemon.daemon.Daemon`` wires them together under one task group. This package
imports nothing at its root, so a plug-in that imports ``tmd.daemon.events`` does not
load the daemon.
"""
