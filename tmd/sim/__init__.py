"""tmd sim: the real daemon's detectors, policies and actuator against a simulated cluster."""
