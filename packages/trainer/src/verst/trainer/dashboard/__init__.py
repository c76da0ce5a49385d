"""`verst dashboard` and `verst report`: a live web view of runs, and the same views as one HTML file.

* `run_data.RunData` reads a run directory incrementally (`tail.JsonlTail`) and builds the
  views: overview, curves, per-step timeline summary, one step's timeline, a page of samples.
* `timeline` turns lifecycle events into attempt rows (queued / generating / scoring, sub-spans
  for turns and tool calls) and per-step summaries.
* `server` serves the page and the JSON views (aiohttp, read-only, 127.0.0.1 by default).
* `report` writes the self-contained HTML report; `assets` holds the page and plotly.js.
* `cli` adds the two subcommands to `verst`.

What the run records for it (`samples.jsonl`, `status.json`) is `verst.trainer.run.recording`.
"""
