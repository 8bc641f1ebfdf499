"""Where a recipe runs.

Two runners start a plan's serve step: `foreground` (a child process of `tool up`, or detached in
its own session, with the limits that can be applied without systemd) and `systemd` (the plan's
units, materialised and started). Both leave a RunRecord (tool.run_record) in <state>/run/<id>.json so
`tool down` and `tool status` find the server later.
"""
