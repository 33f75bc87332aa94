"""The controller behind the kopf handlers: work queue, resync, workers, leader
election on a Lease, metrics and Events. No kopf here (``handlers`` adapts it)."""

from encoderpool_operator.controller.leader import Elector, KubeLeases, Timing, identity
from encoderpool_operator.controller.manager import Controller, connect

__all__ = ["Controller", "Elector", "KubeLeases", "Timing", "connect", "identity"]
