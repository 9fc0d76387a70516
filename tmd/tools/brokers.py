"""A private broker for the demo and tests: mosquitto where it is installed, else the
embedded one, so ``tmd demo`` runs on a bare machine."""

from __future__ import annotations

from tmd.tools.embedded_broker import EmbeddedBroker
from tmd.tools.mosquitto import Mosquitto, find_mosquitto


def local_broker(
    *, host: str = "127.0.0.1", port: int = 0, embedded: bool = False
) -> Mosquitto | EmbeddedBroker:
    """A private broker, not yet started (``with local_broker() as b:``): mosquitto when
    it is installed, else (or with ``embedded``) the embedded one. Both listen on
    ``b.host``, ``b.port`` and stop on exit."""
    if not embedded and find_mosquitto() is not None:
        return Mosquitto(host=host, port=port)
    return EmbeddedBroker(host=host, port=port)
