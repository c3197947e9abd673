"""``celery-ledger metrics``: the ledger's Prometheus gauges without Flower."""

from __future__ import annotations

from typing import Any

import click
from prometheus_client import CollectorRegistry, generate_latest

from celery_ledger.metrics import DEFAULT_PORT, DEFAULT_TTL_SECONDS, LedgerCollector, serve


@click.command("metrics")
@click.option(
    "--port",
    type=int,
    default=DEFAULT_PORT,
    show_default=True,
    help="Port to serve /metrics on (0: any free port).",
)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind (0.0.0.0 inside a container).",
)
@click.option(
    "--ttl",
    type=float,
    default=DEFAULT_TTL_SECONDS,
    show_default=True,
    envvar="CELERY_LEDGER_METRICS_TTL",
    help="Seconds one computation of the aggregates is served.",
)
@click.option("--once", is_flag=True, help="Print the metrics once and exit.")
@click.pass_obj
def metrics_command(obj: Any, port: int, address: str, ttl: float, once: bool) -> None:
    """Serve the ledger's Prometheus gauges without Flower."""
    collector = LedgerCollector(lambda: obj.store, ttl=ttl)
    if once:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(collector)
        click.echo(generate_latest(registry).decode(), nl=False)
        return
    if not 0 <= port <= 65535:
        raise click.ClickException(f"--port {port} is not a TCP port: give 0 to 65535")
    try:
        server = serve(collector, address=address, port=port)
    except (OSError, OverflowError) as exc:  # socket.gaierror is an OSError
        why = getattr(exc, "strerror", None) or exc
        raise click.ClickException(f"cannot serve metrics on {address}:{port}: {why}") from None
    click.echo(
        f"celery-ledger metrics on http://{address}:{server.server_port}/metrics (ttl {ttl:g}s)",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


COMMANDS = [metrics_command]
