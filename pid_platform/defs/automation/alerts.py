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
from dagster._core.definitions.assets.job.asset_job import IMPLICIT_ASSET_JOB_NAME

WEBHOOK_ENV = "PID_ALERT_WEBHOOK_URL"
WEBHOOK_TIMEOUT_S = 10
MAX_ERROR_CHARS = 500  # per step: a chat message, not a traceback (the run's page has that)
log = logging.getLogger("pid_platform.alerts")


MAX_LABEL_ASSETS = 2  # an alert's job label names this many assets, then counts the rest


def job_label(run: dg.DagsterRun) -> str:
    """The run's job as an operator knows it: a Materialize click or an automation run goes through
    Dagster's hidden ``__ASSET_JOB``, named here by the assets it materialized (two of them, then
    how many more: the run's page lists them all, and its checks)."""
    if run.job_name != IMPLICIT_ASSET_JOB_NAME:
        return run.job_name
    assets = sorted(k.to_user_string() for k in run.asset_selection or ())
    if not assets:
        return "materialize checks" if run.asset_check_selection else "materialize assets"
    shown, rest = assets[:MAX_LABEL_ASSETS], len(assets) - MAX_LABEL_ASSETS
    return "materialize " + ", ".join(shown) + (f" and {rest} more" if rest > 0 else "")


def alert_title(run: dg.DagsterRun, failed_steps: list[str]) -> str:
    """The alert in one short line, for a chat message's title: the job, the source, the step
    that failed (the first, and how many more)."""
    source = run.tags.get("dagster/partition")
    steps = sorted(failed_steps)
    step = steps[0] + (f" and {len(steps) - 1} more" if len(steps) > 1 else "") if steps else None
    return f"{job_label(run)} failed" + (f" for {source}" if source else "") + (f" in {step}" if step else "")


def _without_module_path(message: str, cls_name: str) -> str:
    # Dagster renders an error as "module.path.ClassName: message"; an operator needs the class's
    # own name at most.
    head, sep, rest = message.partition(": ")
    if sep and head.endswith("." + cls_name):
        return f"{cls_name}: {rest}"
    return message


def run_failure_alert(run: dg.DagsterRun, error: str | None, failed_steps: list[str],
                      step_errors: dict[str, str] | None = None) -> dict:
    """What is known of a failed run, as plain JSON values; ``step_errors``: each failed step's error."""
    step_errors = step_errors or {}
    why = "; ".join(f"{step}: {message}" for step, message in sorted(step_errors.items())) or error
    return {
        "alert": "dagster_run_failure",
        "title": alert_title(run, failed_steps),
        "text": f"Dagster run {run.run_id[:8]} of {job_label(run)} failed"
                + (f" (partition {run.tags['dagster/partition']})" if "dagster/partition" in run.tags else "")
                + (f": {why}" if why else ""),
        "run_id": run.run_id,
        "job": job_label(run),
        "job_name": run.job_name,
        "partition": run.tags.get("dagster/partition"),
        "code_location": run.remote_job_origin.location_name if run.remote_job_origin else None,
        "failed_steps": failed_steps,
        "step_errors": dict(sorted(step_errors.items())),
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


def step_errors(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    """Failed step -> the first line of what it raised (the cause, not Dagster's wrapper around it)."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records
    errors: dict[str, str] = {}
    for r in records:
        event = r.event_log_entry.dagster_event
        if event is None or event.step_key is None:
            continue
        error = event.step_failure_data.error if event.step_failure_data else None
        while error is not None and error.cause is not None and (
                error.cls_name.startswith("Dagster") or error.cls_name == "Failure"):
            error = error.cause
        lines = (_without_module_path(error.message, error.cls_name) if error else "").strip().splitlines()
        errors[event.step_key] = (lines[0] if lines else "failed")[:MAX_ERROR_CHARS]
    return errors


@dg.run_failure_sensor(
    default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=30,
    description="Raises an alert for every failed run of this code location: a log line (ERROR, logger "
                "pid_platform.alerts) with each failed step's error and, if PID_ALERT_WEBHOOK_URL is set for the "
                "daemon, a JSON POST to that URL.",
)
def run_failure_alert_sensor(context: dg.RunFailureSensorContext) -> None:
    run = context.dagster_run
    error = context.failure_event.message if context.failure_event else None
    errors = step_errors(context.instance, run.run_id)
    alert = run_failure_alert(run, error, sorted(errors), errors)
    line = f"ALERT {alert['text']} (failed steps: {', '.join(alert['failed_steps']) or 'none'})"
    log.error(line)
    context.log.error(line)
    url = os.environ.get(WEBHOOK_ENV, "").strip()
    if url:
        status = post_alert(url, alert)
        context.log.info(f"alert for run {run.run_id} posted to the webhook (HTTP {status})")
