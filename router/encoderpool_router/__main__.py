"""``python -m encoderpool_router``: parse settings, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from encoderpool_router.app import Router, build_app, build_metrics_app, build_probe_app
from encoderpool_router.config import parse_settings
from encoderpool_router.heap import keep_freed_memory
from encoderpool_router.listener import INTERNAL_LIMITS, serve


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request is noise
    keep_freed_memory()  # large bodies reuse freed buffers instead of faulting pages in
    try:
        router = Router(settings)
    except ValueError as e:  # the client token file cannot be used
        print(f"invalid router settings:\n  {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info(
        "router on %s:%s (probes on port %s, metrics on port %s); %s; consumer policy %s; "
        "client auth %s, backend key %s; %s",
        settings.host,
        settings.port,
        settings.probe_port,
        settings.metrics_port,
        f"EndpointSlices of {settings.producer_service or settings.producer_services_by_modality}"
        f" and {settings.consumer_service}"
        if settings.discovery
        else f"producers {list(settings.producers) or dict(settings.producers_by_modality)}, "
        f"consumers {list(settings.consumers)}",
        settings.consumer_policy
        + (
            f" (bound {settings.consumer_load_bound})"
            if settings.consumer_policy == "media-affinity"
            else ""
        ),
        f"from {settings.auth_token_file}" if settings.auth_token_file else "off",
        "set" if settings.backend_api_key is not None else "unset",
        settings.memory_plan.summary(settings.memory_limit_bytes, settings.max_headers),
    )
    # The API first: its start-up (the upstream session, discovery) comes before the
    # probes answer, and its shutdown after theirs.
    apps = [
        (build_app(router), settings.port, settings.api_limits()),
        (build_probe_app(router), settings.probe_port, INTERNAL_LIMITS),
        (build_metrics_app(router), settings.metrics_port, INTERNAL_LIMITS),
    ]
    asyncio.run(serve(apps, settings.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
