"""A pool's Prometheus endpoint, found in its log and scraped."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from harness.procs import wait_for


def metrics_port(pool) -> int:
    found = wait_for(lambda: re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", pool.stderr), 60, message="the metrics log line")
    return int(found.group(1))


def scrape(port: int) -> dict:
    """{(sample name, sorted labels): value}, parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def series(name: str, model: str, **labels) -> tuple:
    return (name, tuple(sorted({"model": model, "adapter": "", **labels}.items())))
