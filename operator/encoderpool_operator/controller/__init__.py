"""The controller behind the kopf handlers: work queue, resync, workers, peering
standby, metrics and Events. No kopf here (``handlers`` adapts it)."""

from encoderpool_operator.controller.manager import Controller, connect
from encoderpool_operator.controller.peering import Peer

__all__ = ["Controller", "Peer", "connect"]
