"""The offline checks: replay's pipeline (scan, rules, slots, provenance, findings, problems)."""
