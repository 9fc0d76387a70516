"""Helpers for tests: a raw MQTT publisher and polling with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion


class Publisher:
    """A plain paho client: publishes raw bytes and waits until the broker has them."""

    def __init__(self, host: str, port: int) -> None:
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        self.client.connect(host, port)
        self.client.loop_start()

    def send(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(5)

    def close(self) -> None:
        # Disconnect first: it wakes the network thread, which loop_stop then joins at
        # once; the other way round, loop_stop waits out the thread's select (up to 1 s).
        # Every paho client of the tests closes in this order.
        self.client.disconnect()
        self.client.loop_stop()


async def eventually(check: Callable[[], Any], *, timeout_s: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {check}")
        await asyncio.sleep(0.02)
