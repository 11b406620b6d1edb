"""The offline checks: replay's pipeline (the plan read from the rule table, the scan, the checks, provenance, findings,
problems)."""
