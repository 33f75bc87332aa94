"""``python -m encoderpool_router``: parse settings, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from encoderpool_router.app import Router, build_app, metrics_lifespan
from encoderpool_router.config import parse_settings
from encoderpool_router.heap import keep_freed_memory
from encoderpool_router.listener import serve


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
        "router on %s:%s (metrics on port %s); %s; consumer policy %s; client auth %s, "
        "backend key %s",
        settings.host,
        settings.port,
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
    )
    app = build_app(router)
    app.cleanup_ctx.append(metrics_lifespan(router, settings.host, settings.metrics_port))
    # Cancels a handler whose client left (so its upstream requests end); caps connections.
    asyncio.run(serve(app, settings.host, settings.port, settings.max_connections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
