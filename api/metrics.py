"""GET /metrics: the fleet's state read from Redis now (jobs/metrics.py) and this API process's own
metrics (``process_*``, ``python_*``), in Prometheus' text format or OpenMetrics, as the scraper's
Accept header asks (docs/metrics.md).

No key is asked for, as for /health: a scraper has none, and nothing here names a tenant, a job or a
text (counts and depths only). Every API process answers the same fleet figures, so Prometheus
scrapes one of them; the workers' counters are on their own endpoints (workers/metrics.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from api.state import AppState, app_state
from jobs.metrics import Families, fleet_metrics

router = APIRouter()


@router.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
async def metrics(request: Request, st: AppState = Depends(app_state)) -> Response:
    registry = CollectorRegistry(auto_describe=False)  # this scrape's: the fleet's families, then ours
    registry.register(Families(await fleet_metrics(st.store, st.settings, st.rq)))
    registry.register(REGISTRY)
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(registry), media_type=content_type)
