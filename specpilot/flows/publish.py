"""Prefect artifacts that make a tune auditable from the UI: attribution reports (plots referenced by URI),
candidate tables, links to every stage manifest, and the final summary."""
from __future__ import annotations

import re
from pathlib import Path

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from specpilot.flows.report import TuneReport
from specpilot.stages.attribute import PLOT_NAME
from specpilot.stages.io import StageOutcome


def artifact_key(*parts: object) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(str(p) for p in parts).lower())).strip("-")


def publish_attribution(deployment: str, round_: int, attribution: StageOutcome) -> None:
    """The attribution report as markdown, its plot referenced by the stored PNG's URI."""
    plot_uri = attribution.manifest().output(PLOT_NAME).uri
    text = (Path(attribution.out_dir) / "report.md").read_text().replace(f"]({PLOT_NAME})", f"]({plot_uri})")
    create_markdown_artifact(text, key=artifact_key(deployment, "attribution", f"r{round_}"),
                             description=f"cost-model attribution, round {round_}; plot at {plot_uri}")


def candidate_rows(explores: list[StageOutcome], validations: list[StageOutcome]) -> list[dict[str, object]]:
    verdicts = {v.meta["candidate"]["name"]: v.meta for v in validations}
    rows = []
    for e in explores:
        for m in e.meta["selected"]:
            c, v = m["candidate"], verdicts.get(m["candidate"]["name"])
            rows.append({"candidate": c["name"], "source": c["source"], "mechanisms": ", ".join(c["mechanisms"]),
                         "tune speedup vs AR": round(m["objective"], 3), "build vs AR (same run)": round(m["baseline"], 3),
                         "token forcing": v["verdict"] if v else "not validated",
                         "held-out vs stock": round(v["speedup_vs_stock"], 3) if v else None})
    return rows


def publish_round(deployment: str, round_: int, stages: list[StageOutcome], explores: list[StageOutcome],
                  validations: list[StageOutcome]) -> None:
    """The round's candidates as a table and a link to every stage manifest it wrote."""
    create_table_artifact(candidate_rows(explores, validations), key=artifact_key(deployment, "candidates", f"r{round_}"),
                          description=f"round {round_}: explored candidates handed to validation")
    for outcome in stages:
        create_link_artifact(outcome.manifest_uri,
                             link_text=f"{outcome.label} manifest ({len(outcome.manifest().outputs)} outputs)",
                             key=artifact_key(deployment, outcome.label))


def publish_timeline(deployment: str, round_: int, explores: list[StageOutcome]) -> None:
    """When each explore task ran and on which device: on several GPUs their windows overlap."""
    rows = [{"task": o.label, "device": o.timing.device, "host": o.timing.host, "started": o.timing.started,
             "finished": o.timing.finished, "seconds": round(o.timing.seconds, 2)} for o in explores if o.timing]
    create_table_artifact(rows, key=artifact_key(deployment, "explore-timeline", f"r{round_}"),
                          description=f"round {round_}: explore tasks, one per device, with start and end (UTC)")


def publish_summary(deployment: str, report: TuneReport) -> None:
    create_markdown_artifact(report.table(), key=artifact_key(deployment, "tune-summary"),
                             description=f"tune run {report.run_id}")
    create_link_artifact(report.build_uri, link_text=f"final build {report.final_build}",
                         key=artifact_key(deployment, "final-build"))
