"""The run-failure alert: every failed run of this code location, as a log line and, when
``PID_ALERT_WEBHOOK_URL`` is set, as a JSON POST to that URL (Slack-style incoming webhooks, an
on-call tool, anything that takes JSON).

A POST that fails fails the sensor's tick (shown in the UI under the sensor) and is tried again
on the next tick; the log line is written on every try.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request

import dagster as dg

WEBHOOK_ENV = "PID_ALERT_WEBHOOK_URL"
WEBHOOK_TIMEOUT_S = 10
log = logging.getLogger("pid_platform.alerts")


def run_failure_alert(run: dg.DagsterRun, error: str | None, failed_steps: list[str]) -> dict:
    """What is known of a failed run, as plain JSON values."""
    return {
        "alert": "dagster_run_failure",
        "text": f"Dagster run {run.run_id[:8]} of {run.job_name} failed"
                + (f" (partition {run.tags['dagster/partition']})" if "dagster/partition" in run.tags else "")
                + (f": {error}" if error else ""),
        "run_id": run.run_id,
        "job": run.job_name,
        "partition": run.tags.get("dagster/partition"),
        "code_location": run.remote_job_origin.location_name if run.remote_job_origin else None,
        "failed_steps": failed_steps,
        "error": error,
        "tags": {k: v for k, v in sorted(run.tags.items()) if not k.startswith(".dagster")},
    }


def post_alert(url: str, alert: dict) -> int:
    """POST ``alert`` as JSON to ``url``; the HTTP status. Raises with the URL on any failure."""
    request = urllib.request.Request(url, data=json.dumps(alert, sort_keys=True).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
            return response.status
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"alert webhook {url} ({WEBHOOK_ENV}) did not take the alert: {exc}") from exc


def _failed_steps(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records
    return sorted({r.event_log_entry.dagster_event.step_key for r in records if r.event_log_entry.dagster_event})


@dg.run_failure_sensor(default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=30)
def run_failure_alert_sensor(context: dg.RunFailureSensorContext) -> None:
    """Writes an alert for every failed run of this code location: a log line (level ERROR,
    logger ``pid_platform.alerts``) and, if ``PID_ALERT_WEBHOOK_URL`` is set, a JSON POST to it."""
    run = context.dagster_run
    error = context.failure_event.message if context.failure_event else None
    alert = run_failure_alert(run, error, _failed_steps(context.instance, run.run_id))
    line = f"ALERT {alert['text']} (failed steps: {', '.join(alert['failed_steps']) or 'none'})"
    log.error(line)
    context.log.error(line)
    url = os.environ.get(WEBHOOK_ENV, "").strip()
    if url:
        status = post_alert(url, alert)
        context.log.info(f"alert for run {run.run_id} posted to the webhook (HTTP {status})")
