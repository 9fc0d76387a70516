"""Developer and demo tooling: ``tmd demo``, the ``tmd bench`` benchmarks, synthetic
load and labelled traces, a private mosquitto and the embedded broker.

Nothing in the daemon, the agent or the runtime imports this package.
"""
