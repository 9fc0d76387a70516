"""tmd: keeps large PyTorch training jobs running by live-migrating a slow or failing
machine's work to a pre-warmed standby.

This package root stays import-light: the training runtime (``tmd.runtime``) imports
``tmd.wire`` from inside training processes and must not pull in the daemon.
"""

__version__ = "0.1.0"
